"""vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /version`` (same request and reply shapes).

``/tokenize`` takes a ``prompt`` (completions form) or ``messages`` (chat form, the model's chat
template). ``model`` is the base or an adapter name (404 when unknown), as on the OpenAI routes.
``adapter_id`` (LoRAX's field) is accepted as another way to name the adapter: it must name a loaded
adapter (404 otherwise) and agree with ``model`` when both name one (400 naming ``adapter_id``).
Adapters share the base tokenizer, so the selection only validates the name.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import get, post
from litestar.status_codes import HTTP_200_OK

import lorastar
from lorastar.plugin.errors import APIError, error_responses
from lorastar.plugin.routes.chat import render_messages
from lorastar.plugin.routes.common import in_thread
from lorastar.plugin.schemas import ChatMessageParam
from lorastar.plugin.service import LoraStarService


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages (vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # rendered by the chat template, as on the chat route
    chat_template: None = None  # refused, as on the chat route (UNSUPPORTED_FIELDS)
    return_token_strs: bool = False
    adapter_id: str | None = None


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None
    adapter_id: str | None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class VersionResponse(msgspec.Struct, kw_only=True):
    version: str


def build_tokenize_handlers(service: LoraStarService, *, guards: list[Any] | None = None) -> list[Any]:
    guards = guards or []

    errors = error_responses(400, *((401,) if guards else ()), 404, 503)

    @post(
        "/tokenize",
        status_code=HTTP_200_OK,
        guards=guards,
        summary="Tokenize a prompt or messages",
        responses=errors,
    )
    async def tokenize(data: TokenizeRequest) -> TokenizeResponse:
        engine = await service.ready()
        await service.resolve_adapter(data.model, data.adapter_id)
        if (data.prompt is None) == (data.messages is None):
            raise APIError("Give exactly one of 'prompt' and 'messages'.", param="prompt")
        if data.messages is not None:
            _, ids = await render_messages(
                engine, data.messages, data.add_generation_prompt, bool(data.add_special_tokens),
                continue_final_message=data.continue_final_message,
                chat_template_kwargs=data.chat_template_kwargs, tools=data.tools,
            )  # fmt: skip
        else:
            add = True if data.add_special_tokens is None else data.add_special_tokens
            engine.check_prompt_size(data.prompt or "")  # before any tokenizing
            ids = await in_thread(
                lambda: list(engine.tokenizer(data.prompt, add_special_tokens=add)["input_ids"])
            )
        strs = engine.tokenizer.convert_ids_to_tokens(ids) if data.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs
        )

    @post(
        "/detokenize",
        status_code=HTTP_200_OK,
        guards=guards,
        summary="Detokenize token ids",
        responses=errors,
    )
    async def detokenize(data: DetokenizeRequest) -> DetokenizeResponse:
        engine = await service.ready()
        await service.resolve_adapter(data.model, data.adapter_id)
        bad = [t for t in data.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(f"token id {bad[0]} is out of range [0, {engine.vocab_size}).", param="tokens")
        # on a worker thread: a 10 MB body's ~2M ids take the tokenizer most of a second
        return DetokenizeResponse(prompt=await in_thread(engine.tokenizer.decode, data.tokens))

    @get("/version", sync_to_thread=False, summary="lorastar version")
    def version() -> VersionResponse:
        return VersionResponse(version=lorastar.__version__)

    return [tokenize, detokenize, version]
