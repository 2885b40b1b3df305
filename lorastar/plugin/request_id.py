"""Request ids a client or gateway gives (vLLM's): ``X-Request-Id`` / ``request_id`` name the
answer, and ``--enable-request-id-headers`` echoes the header on every answer of lorastar's routes."""

from __future__ import annotations

import uuid
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


def request_id_middleware(app: Any) -> Any:
    """ASGI middleware: each HTTP answer carries ``X-Request-Id``, the request's own or a new one."""

    async def middleware(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k.lower() == _HEADER_BYTES), b"")
        rid = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", ()) if bytes(h[0]).lower() != _HEADER_BYTES]
                message = {**message, "headers": [*headers, (_HEADER_BYTES, rid)]}
            await send(message)

        await app(scope, receive, send_with_id)

    return middleware
