"""``/models`` and ``/models/{id}``: the base model and its adapters (``parent`` = the base)."""

from __future__ import annotations

import time
from typing import Any

from litestar import get

from lorastar.hub import is_hub_id
from lorastar.plugin.errors import APIError, error_responses
from lorastar.plugin.routes.common import random_id
from lorastar.plugin.schemas import ModelCard, ModelList, ModelPermission
from lorastar.plugin.service import LoraStarService, relative_to_root


def build_model_handlers(service: LoraStarService, guards: list[Any]) -> list[Any]:
    async def model_cards() -> list[ModelCard]:
        engine = await service.ready()
        base = service.served_model_name
        now = int(time.time())
        model_path = service.config.model or service.config.engine.model
        root = base
        if model_path:  # never a server path: the folder's name, or the hub id (vLLM: the model argument)
            root = model_path if is_hub_id(model_path) else relative_to_root(None, model_path)
        cards = [  # one per served name, as vLLM lists them
            ModelCard(
                id=name,
                created=service.created,
                root=root,
                parent=None,
                max_model_len=int(engine.max_model_len),
                permission=[ModelPermission(id=random_id("modelperm"), created=now)],
            )
            for name in service.served_model_names
        ]
        for a in engine.list_adapters():
            cards.append(
                ModelCard(
                    id=a.name,
                    created=service.adapter_created.get(a.name, service.created),
                    root=relative_to_root(service.adapter_root, a.path),
                    parent=base,
                    permission=[ModelPermission(id=random_id("modelperm"), created=now)],
                )
            )
        return cards

    auth = (401,) if guards else ()

    @get(
        "/models",
        guards=guards,
        summary="List the base model and its adapters",
        responses=error_responses(*auth, 503),
    )
    async def list_models() -> ModelList:
        return ModelList(data=await model_cards())

    @get(
        "/models/{model_id:path}",  # a path: served names and adapter names may hold "/" (org/name)
        guards=guards,
        summary="One model (OpenAI's retrieve)",
        responses=error_responses(*auth, 404, 503),
    )
    async def retrieve_model(model_id: str) -> ModelCard:
        model_id = model_id.removeprefix("/")  # Litestar's path parameters start with the "/"
        for card in await model_cards():
            if card.id == model_id:
                return card
        raise APIError(f"The model `{model_id}` does not exist.", 404, param="model")

    return [list_models, retrieve_model]
