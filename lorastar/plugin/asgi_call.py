"""Drive an ASGI app in-process for one buffered HTTP request, yielding what it sends.

The Ray replica receives requests as plain values through a Ray handle (no socket) and
``lorastar run-batch`` reads them from a file, so each plays the ASGI server itself: the request body is handed over in one ``http.request`` message,
``http.disconnect`` follows only when the caller stops consuming (a client that went away).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

Headers = list[tuple[bytes, bytes]]
DISCONNECT_GRACE_S = 1.0  # the app's time to react to http.disconnect before it is cancelled


@dataclass(frozen=True)
class ResponseStart:
    """The first item :func:`call_asgi` yields: status and raw headers, as the app sent them."""

    status: int
    headers: Headers

    def header(self, name: bytes) -> bytes | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)


def http_scope(method: str, path: str, query_string: bytes, headers: Headers) -> dict[str, Any]:
    """An ASGI 3 ``http`` scope for a request that arrived through a proxy (client unknown)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method.upper(),
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query_string,
        "root_path": "",
        "headers": headers,
        "client": None,
        "server": None,
        "state": {},
    }


async def call_asgi(app: Any, scope: dict[str, Any], body: bytes) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``app`` on one request: yields one :class:`ResponseStart`, then the body's chunks.

    Closing the iterator early (the consumer disconnected) tells the app ``http.disconnect`` and
    cancels it after ``DISCONNECT_GRACE_S``, so a streaming generation is aborted in the engine
    rather than left running.
    """
    sent: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> dict[str, Any]:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await sent.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], [tuple(h) for h in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if chunk := message.get("body", b""):
                    yield chunk
                if not message.get("more_body", False):
                    break
        # The response is complete: as a server does, receive() now answers http.disconnect (a
        # Litestar stream waits for it after its last chunk: without it, a consumer that reads a
        # streamed answer to its end, as curl does through Ray, waited forever).
        disconnected.set()
        await task  # re-raises what the app raised after its response
    finally:
        disconnected.set()
        if not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_GRACE_S)
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
