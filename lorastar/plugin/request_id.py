"""Request ids a client or gateway gives (vLLM's): ``X-Request-Id`` / ``request_id`` name the
answer, and ``--enable-request-id-headers`` echoes the header on every answer under lorastar's paths."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

from lorastar.plugin.errors import APIError
from lorastar.plugin.schemas import MAX_REQUEST_ID

HEADER = "x-request-id"
_HEADER_BYTES = HEADER.encode()


def request_ids(prefix: str, request: Any, body_id: str | None) -> tuple[str, str]:
    """(The answer's ``id``, the engine's request id.) vLLM's ``{prefix}-{id}``, the id being the
    request's ``X-Request-Id`` header, else its body's ``request_id``, else a random one. A client's
    id may repeat (retries, two clients, one gateway trace): the engine's id then gets a random
    suffix, so each request stays its own and aborting one ends only it."""
    client = request.headers.get(HEADER) or body_id
    if not client:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        return rid, rid
    if len(client) > MAX_REQUEST_ID:
        raise APIError(f"X-Request-Id is longer than {MAX_REQUEST_ID} characters", param="X-Request-Id")
    rid = f"{prefix}-{client}"
    return rid, f"{rid}-{uuid.uuid4().hex[:12]}"


def request_id_hook(paths: Iterable[str]) -> Any:
    """A Litestar ``before_send`` hook: each answer under ``paths`` (a path or a folder of paths)
    carries ``X-Request-Id``, the request's own or a new one. App-wide rather than a router's
    middleware, which the 404 / 405 Litestar answers before routing never reach."""
    from litestar.datastructures import MutableScopeHeaders

    exact = tuple(sorted({p.split("{")[0].rstrip("/") or "/" for p in paths}))
    folders = tuple(p.rstrip("/") + "/" for p in exact if p != "/")

    async def hook(message: Any, scope: Any) -> None:
        if message["type"] != "http.response.start" or scope.get("type") != "http":
            return
        path = scope.get("path", "")
        if path not in exact and not path.startswith(folders):
            return
        given = next((v for k, v in scope["headers"] if k.lower() == _HEADER_BYTES), b"")
        MutableScopeHeaders.from_message(message)[HEADER] = (given or uuid.uuid4().hex.encode()).decode(
            "latin-1"
        )

    return hook
