"""The ingress deployment: reads ``model`` from the JSON body and forwards to a replica.

Adapter requests carry ``multiplexed_model_id=model`` on the handle, so Ray's router prefers a
replica that already holds the adapter; requests for the base model (or for ``config.adapters``,
which every replica holds) and every other route go to any replica. Responses stream through the
handle (``stream=True``): server-sent events reach the client chunk by chunk.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from lorastar.plugin.asgi_call import ResponseStart
from lorastar.plugin.errors import APIError, app_path
from lorastar.plugin.routes import messages, responses
from lorastar.plugin.sse import DONE, event_frame, frame

ROUTINGS = ("multiplexed", "adapter_blind")


def model_of(method: str, body: bytes, field: str = "model") -> str | None:
    """The ``model`` (or ``field``) of a JSON object body, else ``None`` (the routes report bad bodies)."""
    if method.upper() != "POST" or not body:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    model = data.get(field) if isinstance(data, dict) else None
    return model if isinstance(model, str) and model else None


class LoraStarIngress:
    """Thin HTTP front: no engine, no model weights; one per app is enough for CPU tests.

    ``routing="adapter_blind"`` sends adapter requests without a multiplexed id (Serve's default
    router, which ignores which adapters a replica holds): the benchmark's baseline.
    """

    def __init__(self, replicas: Any, base_names: list[str], routing: str = "multiplexed") -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        self.replicas = replicas
        self.base_names = frozenset(base_names)
        self.routing = routing

    def adapter_of(self, method: str, body: bytes) -> str | None:
        model = model_of(method, body)
        if model is None or model in self.base_names:
            # LoRAX's ``adapter_id`` names the adapter when ``model`` does not (the routes accept it)
            model = model_of(method, body, "adapter_id") if b'"adapter_id"' in body else None
        return None if model is None or model in self.base_names else model

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        adapter = self.adapter_of(request.method, body)
        options: dict[str, Any] = {"stream": True}
        if adapter is not None and self.routing == "multiplexed":
            options["multiplexed_model_id"] = adapter
        stream = self.replicas.options(**options).handle_http.remote(
            adapter,
            request.method,
            app_path(request.scope),  # relative to serve.run's route_prefix (the scope's root_path)
            request.scope.get("query_string", b""),  # the raw bytes, as the client sent them
            [(k.lower(), v) for k, v in request.headers.raw],
            body,
        )
        try:
            start = await stream.__anext__()
            if not isinstance(start, ResponseStart):
                raise TypeError(f"replica sent {type(start).__name__} before the response start")
        except Exception as exc:  # a replica died or Ray failed: an OpenAI error, never a bare 500
            return _unavailable(exc)
        content_type = (start.header(b"content-type") or b"").decode("latin-1")
        if content_type.startswith("text/event-stream"):
            response: Response = StreamingResponse(
                _rest(stream, app_path(request.scope)), status_code=start.status
            )
        else:
            try:
                body = b"".join([chunk async for chunk in stream])
            except Exception as exc:  # the replica died mid-response: its start is void
                return _unavailable(exc)
            response = Response(body, status_code=start.status)
        response.raw_headers = list(start.headers)
        return response


def _lost(exc: BaseException) -> APIError:
    return APIError(f"No replica could serve the request ({type(exc).__name__}).", 503)


def _unavailable(exc: BaseException) -> Response:
    return Response(msgspec.json.encode(_lost(exc).body()), 503, media_type="application/json")


_SEQUENCE = re.compile(rb'"sequence_number":\s*(\d+)')


def stream_error(path: str, sent: bytes, error: APIError) -> bytes:
    """The in-band error that ends a stream cut off by its replica, in the route's own framing,
    as the plugin ends a stream whose engine failed: ``data: {"error": ...}`` then ``[DONE]``;
    an ``error`` event for the Messages and Responses APIs (``sent``: the stream's last chunk,
    whose ``sequence_number`` the Responses event follows)."""
    if path.rstrip("/").endswith("/messages"):
        return event_frame(messages.error_event(error, None))
    if path.rstrip("/").endswith("/responses"):
        numbers = _SEQUENCE.findall(sent)
        last = {"sequence_number": int(numbers[-1])} if numbers else None
        return event_frame(responses.error_event(error, last))
    return frame(error.body()) + DONE


async def _rest(stream: Any, path: str) -> AsyncIterator[bytes]:
    sent = b""
    try:
        async for chunk in stream:
            sent = chunk
            yield chunk
    except Exception as exc:  # the replica died mid-stream: end it as the plugin ends a failed one
        yield stream_error(path, sent, _lost(exc))
