"""Server-sent events exactly as vLLM frames them: ``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``.

(Litestar's ``ServerSentEvent`` would frame with ``\\r\\n``; OpenAI clients expect ``\\n\\n``.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIType, Operation, Reference, Schema
from litestar.response import Stream

from lorastar.plugin.errors import APIError, to_api_error

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_encoder = msgspec.json.Encoder()


def frame(obj: Any) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


async def _framed(
    events: AsyncIterator[Any],
    encode: Callable[[Any], bytes],
    error_frame: Callable[[APIError, Any], bytes],
    retry_after: int,
) -> AsyncIterator[bytes]:
    """``events`` each framed by ``encode``; an error after the stream started becomes one in-band
    frame, ``error_frame(error, the last event sent)``. A disconnect cancels ``events`` (aborting)."""
    last: Any = None
    try:
        async for event in events:
            last = event
            yield encode(event)
    except Exception as exc:  # CancelledError (disconnect) is a BaseException and passes through
        yield error_frame(to_api_error(exc, retry_after=retry_after), last)
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


async def sse_frames(events: AsyncIterator[Any], *, retry_after: int = 1) -> AsyncIterator[bytes]:
    """Frame ``events`` (Structs/dicts) as ``data:`` frames; an error after the stream started is one
    ``data: {"error": ...}`` frame; then ``[DONE]``."""
    async for chunk in _framed(events, frame, lambda error, _: frame(error.body()), retry_after):
        yield chunk
    yield DONE


def _event_stream(frames: AsyncIterator[bytes]) -> Stream:
    return Stream(frames, media_type="text/event-stream", status_code=200, headers=SSE_HEADERS)


def sse_response(events: AsyncIterator[Any], *, retry_after: int = 1) -> Stream:
    return _event_stream(sse_frames(events, retry_after=retry_after))


def event_frame(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + _encoder.encode(event) + b"\n\n"


def sse_event_frames(
    events: AsyncIterator[dict[str, Any]],
    error_event: Callable[[APIError, dict[str, Any] | None], dict[str, Any]],
    *,
    retry_after: int = 1,
) -> AsyncIterator[bytes]:
    """Typed events as the Responses and Messages APIs frame them: ``event: {type}`` then
    ``data: {json}``, no ``[DONE]``. An error after the stream started is one event,
    ``error_event(error, the last event sent)``, in the API's own shape."""
    return _framed(
        events, event_frame, lambda error, last: event_frame(error_event(error, last)), retry_after
    )


def sse_event_response(
    events: AsyncIterator[dict[str, Any]],
    error_event: Callable[[APIError, dict[str, Any] | None], dict[str, Any]],
    *,
    retry_after: int = 1,
) -> Stream:
    return _event_stream(sse_event_frames(events, error_event, retry_after=retry_after))


# Key of a placeholder response entry that carries a route's stream-chunk model through
# Litestar's schema generation (so the chunk becomes a named component); StreamingOperation
# moves it under 200's ``text/event-stream``.
STREAM_CHUNK = 299


@dataclass
class StreamingOperation(Operation):
    """OpenAPI operation of a route that answers JSON, or server-sent events with ``stream: true``
    (each ``data:`` frame one chunk model, then ``data: [DONE]``)."""

    def __post_init__(self) -> None:
        responses = self.responses or {}
        chunk = responses.pop(str(STREAM_CHUNK), None)
        ok = responses.get("200")
        content = getattr(ok, "content", None)
        chunk_content = getattr(chunk, "content", None)
        if content is not None and chunk_content:
            chunk = next(iter(chunk_content.values())).schema
            error = Reference(ref="#/components/schemas/ErrorResponse")
            json_frame = Schema(
                type=OpenAPIType.STRING,
                content_media_type="application/json",
                content_schema=Schema(any_of=[chunk, error]),  # type: ignore[list-item]
            )
            done = Schema(type=OpenAPIType.STRING, const="[DONE]")
            # One SSE event per frame: its `data` is a chunk (or an error) as JSON, or [DONE].
            event = Schema(
                type=OpenAPIType.OBJECT,
                required=["data"],
                properties={"data": Schema(any_of=[json_frame, done])},
            )
            content["text/event-stream"] = OpenAPIMediaType(schema=event)


@dataclass
class TypedEventsOperation(Operation):
    """OpenAPI operation of a route that answers JSON, or typed server-sent events with
    ``stream: true`` (the Responses and Messages APIs: ``event: {type}`` then ``data: {json}``, one
    event model per frame, errors included, no ``[DONE]``)."""

    def __post_init__(self) -> None:
        responses = self.responses or {}
        chunk = responses.pop(str(STREAM_CHUNK), None)
        content = getattr(responses.get("200"), "content", None)
        chunk_content = getattr(chunk, "content", None)
        if content is not None and chunk_content:
            data = Schema(
                type=OpenAPIType.STRING,
                content_media_type="application/json",
                content_schema=next(iter(chunk_content.values())).schema,
            )
            event = Schema(
                type=OpenAPIType.OBJECT,
                required=["event", "data"],
                properties={"event": Schema(type=OpenAPIType.STRING), "data": data},
            )
            content["text/event-stream"] = OpenAPIMediaType(schema=event)
