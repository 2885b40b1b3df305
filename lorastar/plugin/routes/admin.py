"""Runtime adapter admin: vLLM's ``/load_lora_adapter`` and ``/unload_lora_adapter``.

Bodies and replies as in vLLM (200 with a plain-text success line). Guarded by the admin bearer
token; paths are confined to ``adapter_root``.
"""

from __future__ import annotations

import hmac
import inspect
import time
from typing import Any

from litestar import MediaType, Response, post
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.status_codes import HTTP_200_OK, HTTP_409_CONFLICT

from lorastar.adapters.info import check_name  # torch-free, unlike the registry
from lorastar.errors import AdapterError, AdapterExistsError, AdapterNotFoundError
from lorastar.plugin.errors import APIError, error_responses, not_found, unauthorized
from lorastar.plugin.schemas import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from lorastar.plugin.service import LoraStarService, confine


def bearer_token(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    value = connection.headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def token_matches(token: str | None, allowed: list[str]) -> bool:
    # compare_digest against every key (no early exit on the first match: constant-ish time).
    ok = False
    for key in allowed:
        if token is not None and hmac.compare_digest(token.encode(), key.encode()):
            ok = True
    return ok


def admin_guard(service: LoraStarService) -> Any:
    def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        expected = service.admin_token
        if expected is None:
            raise unauthorized("Adapter admin is disabled: no admin token is configured.")
        if not token_matches(bearer_token(connection), [expected]):
            raise unauthorized("Invalid or missing admin token.")

    return guard


def _takes_new(load: Any) -> bool:
    """Whether an engine client's ``load_adapter`` takes ``new`` (a client written before it: no)."""
    try:
        return "new" in inspect.signature(load).parameters
    except (TypeError, ValueError):
        return False


def _text(message: str) -> Response[str]:
    return Response(message, status_code=HTTP_200_OK, media_type="text/plain")


def build_admin_handlers(service: LoraStarService) -> list[Any]:
    guards = [admin_guard(service)]

    @post(
        "/load_lora_adapter",
        status_code=HTTP_200_OK,
        guards=guards,
        summary="Load a LoRA adapter",
        media_type=MediaType.TEXT,
        responses=error_responses(400, 401, 403, 503),
    )
    async def load_lora_adapter(data: LoadLoRAAdapterRequest) -> Response[str]:
        engine = await service.ready()
        name, path = data.lora_name, data.lora_path
        if not name or not path:
            raise APIError(
                "Both 'lora_name' and 'lora_path' must be provided.",
                param="lora_name" if not name else "lora_path",
            )
        if name in service.served_model_names:
            raise APIError(
                f"The lora adapter '{name}' clashes with the base model's name.", param="lora_name"
            )
        try:  # the registry's rule, before any file is read
            check_name(name)
        except AdapterError as exc:
            raise APIError(str(exc), param="lora_name") from exc
        resolved = confine(service.adapter_root, path)
        # Held across the check and the load: a second load of a new name waits, then finds it loaded.
        async with service.adapter_lock(name):
            if name in service.adapter_names() and not data.load_inplace:
                raise APIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
            # load_inplace: the engine re-registers the name atomically (in-flight requests keep the
            # old weights; a failed load leaves the old adapter in place).
            # new: the engine's own check too (workers sharing one core each hold their own lock);
            # an engine client written before ``new`` is called as before.
            new = {"new": True} if not data.load_inplace and _takes_new(engine.load_adapter) else {}
            try:
                await engine.load_adapter(name, str(resolved), **new)
            except AdapterExistsError as exc:
                raise APIError(str(exc), param="lora_name") from exc
            except AdapterError as exc:
                reason = service.scrub_paths(str(exc))
                raise APIError(
                    f"Failed to load the lora adapter '{name}': {reason}", param="lora_path"
                ) from exc
            service.adapter_created[name] = int(time.time())
        return _text(f"Success: LoRA adapter '{name}' added successfully.")

    @post(
        "/unload_lora_adapter",
        status_code=HTTP_200_OK,
        guards=guards,
        summary="Unload a LoRA adapter",
        media_type=MediaType.TEXT,
        responses=error_responses(400, 401, 404, 503),
    )
    async def unload_lora_adapter(data: UnloadLoRAAdapterRequest) -> Response[str]:
        engine = await service.ready()
        name = data.lora_name
        if not name:
            raise APIError("'lora_name' must be provided.", param="lora_name")
        try:
            await engine.unload_adapter(name)
        except AdapterNotFoundError as exc:
            raise not_found(f"The lora adapter '{name}' cannot be found.", "lora_name") from exc
        service.adapter_created.pop(name, None)
        service.metrics.forget_adapter(name)
        return _text(f"Success: LoRA adapter '{name}' removed successfully.")

    return [load_lora_adapter, unload_lora_adapter]


def build_reset_prefix_cache_handler(service: LoraStarService) -> Any:
    """vLLM's ``POST /reset_prefix_cache`` (behind its dev mode there; behind the admin token here)."""

    @post(
        "/reset_prefix_cache",
        guards=[admin_guard(service)],
        status_code=HTTP_200_OK,
        summary="Forget every cached prefix (admin token)",
        media_type=MediaType.TEXT,
        responses=error_responses(401, 409, 503),
    )
    async def reset_prefix_cache() -> Response[str]:
        engine = await service.ready()
        if not await engine.reset_prefix_cache():
            raise APIError(
                "Requests are running: the prefix cache was not reset (retry when the server is idle).",
                HTTP_409_CONFLICT,
            )
        return _text("Success: the prefix cache was reset.")

    return reset_prefix_cache
