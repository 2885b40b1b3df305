"""``/health`` (and SageMaker's ``/ping``), ``/metrics`` and ``/load``."""

from __future__ import annotations

import math
from typing import Any

from litestar import MediaType, Response, get, route
from litestar.status_codes import HTTP_200_OK, HTTP_503_SERVICE_UNAVAILABLE

from lorastar.plugin.errors import APIError, app_path, error_responses
from lorastar.plugin.metrics import CONTENT_TYPE
from lorastar.plugin.service import LoraStarService


def build_health_handler(
    service: LoraStarService, path: str, include_in_schema: bool, methods: tuple[str, ...] = ("GET",)
) -> Any:
    """``methods``: SageMaker's ``/ping`` takes GET and POST."""

    @route(
        path,
        http_method=list(methods),
        sync_to_thread=False,
        include_in_schema=include_in_schema,
        summary="Engine liveness",
        media_type=MediaType.TEXT,
        responses=error_responses(503),
    )
    def health() -> Response[Any]:
        # vLLM answers 200 with an empty body; 503 once the engine loop died (or before it started).
        if service.healthy():
            return Response(b"", status_code=HTTP_200_OK, media_type="text/plain")
        engine = service.engine
        if service.started and engine is not None and engine.restarting:
            # as every other 503 of a restart (errors.to_api_error): the larger of the two
            wait = max(service.config.retry_after_seconds, math.ceil(max(engine.retry_after, 1.0)))
            return APIError(
                "The engine is restarting after a failure.",
                HTTP_503_SERVICE_UNAVAILABLE,
                headers={"Retry-After": str(wait)},
            ).to_response()
        if service.closed:  # draining: a balancer's probe takes the server out of rotation
            return APIError(
                "The server is shutting down.",
                HTTP_503_SERVICE_UNAVAILABLE,
                headers={"Retry-After": str(service.config.retry_after_seconds)},
            ).to_response()
        message = "The engine has stopped." if service.started else "The engine is not running."
        return APIError(message, HTTP_503_SERVICE_UNAVAILABLE).to_response()

    return health


def build_metrics_handler(
    service: LoraStarService, path: str, include_in_schema: bool, guards: list[Any] | None = None
) -> Any:
    @get(
        path,
        sync_to_thread=True,  # in a worker thread: the engine's stats() waits for its step lock
        include_in_schema=include_in_schema,
        guards=guards or [],
        summary="Prometheus metrics",
        media_type=CONTENT_TYPE,
        responses=error_responses(401) if guards else None,
    )
    def metrics() -> Response[bytes]:
        return Response(service.metrics.render(), status_code=HTTP_200_OK, media_type=CONTENT_TYPE)

    return metrics


def build_load_handler(service: LoraStarService, include_in_schema: bool) -> Any:
    @get("/load", sync_to_thread=False, include_in_schema=include_in_schema, summary="Server load")
    def load() -> dict[str, int]:
        # vLLM's --enable-server-load-tracking answer
        return {"server_load": service.server_load}

    return load


def load_tracking(service: LoraStarService, api_path: str) -> Any:
    """ASGI middleware (for the OpenAI router) counting the generation requests being answered in
    ``service.server_load``: from the request's arrival to the response's end (a stream's last
    event), errors included, as vLLM's ``load_aware_call`` counts them."""
    counted = {
        f"{api_path}{r}"
        for r in ("/chat/completions", "/completions", "/embeddings", "/responses", "/messages")
    }

    def middleware(app: Any) -> Any:
        async def tracked(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http" or scope["method"] != "POST" or app_path(scope) not in counted:
                await app(scope, receive, send)
                return
            service.server_load += 1
            try:
                await app(scope, receive, send)
            finally:
                service.server_load -= 1

        return tracked

    return middleware
