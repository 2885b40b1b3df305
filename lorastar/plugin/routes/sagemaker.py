"""Amazon SageMaker's container contract, as ``vllm serve`` serves it: ``/ping`` (in
``plugin.py``: the health answer) and ``POST /invocations``, which hands the body to the chat
completions route (a body with ``messages``), the completions route (one with ``prompt``) or the
embeddings route (one with ``input``), as vLLM's.

``/invocations`` is a raw ASGI route: it reads the body, picks the route, and runs the app again
on the same connection with the path rewritten, so the chosen route answers as itself (its
validation, its API-key guard, its streaming) and ``/invocations`` adds nothing in between.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Litestar, asgi
from litestar.status_codes import HTTP_400_BAD_REQUEST, HTTP_405_METHOD_NOT_ALLOWED

from lorastar.plugin.errors import APIError

# The ASGI keys of a fresh request: what Litestar added while routing to /invocations stays behind.
_REQUEST_KEYS = (
    "type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "query_string",
    "root_path", "headers", "client", "server", "extensions",
)  # fmt: skip


def invocations_target(body: bytes, api_path: str) -> str:
    """The route path that answers an ``/invocations`` body; ``APIError`` (400) for anything else."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise APIError(f"The body is not valid JSON: {exc}", HTTP_400_BAD_REQUEST) from None
    if isinstance(data, dict):
        if "messages" in data:
            return f"{api_path}/chat/completions"
        if "prompt" in data:
            return f"{api_path}/completions"
        if "input" in data:
            return f"{api_path}/embeddings"
    raise APIError(
        "/invocations takes a chat completions request (with 'messages'), a completions request "
        "(with 'prompt') or an embeddings request (with 'input').",
        HTTP_400_BAD_REQUEST,
    )


def build_invocations_handler(api_path: str) -> Any:
    """(An ASGI route: never in the OpenAPI schema.)"""

    @asgi("/invocations", copy_scope=True)
    async def invocations(scope: Any, receive: Any, send: Any) -> None:
        if scope["method"] != "POST":
            raise APIError("Method Not Allowed", HTTP_405_METHOD_NOT_ALLOWED, headers={"Allow": "POST"})
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        target = invocations_target(body, api_path)  # (an APIError: the plugin's handler answers it)
        path = (scope.get("root_path") or "").rstrip("/") + target
        inner = {k: scope[k] for k in _REQUEST_KEYS if k in scope}
        inner.update(path=path, raw_path=path.encode(), state={})
        given = False

        async def replay() -> Any:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # the client's disconnect, if it goes away

        await Litestar.from_scope(scope)(inner, replay, send)  # type: ignore[arg-type]

    return invocations
