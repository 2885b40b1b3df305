"""``/health`` and ``/metrics``."""

from __future__ import annotations

from typing import Any

from litestar import Response, get
from litestar.status_codes import HTTP_200_OK, HTTP_503_SERVICE_UNAVAILABLE

from lorastar.plugin.errors import APIError
from lorastar.plugin.metrics import CONTENT_TYPE
from lorastar.plugin.service import LoraStarService


def build_health_handler(service: LoraStarService, path: str, include_in_schema: bool) -> Any:
    @get(path, sync_to_thread=False, include_in_schema=include_in_schema, summary="Engine liveness")
    def health() -> Response[Any]:
        # vLLM answers 200 with an empty body; 503 once the engine loop died (or before it started).
        if service.healthy():
            return Response(b"", status_code=HTTP_200_OK, media_type="text/plain")
        message = "The engine is dead." if service.started else "The engine is not running."
        return APIError(message, HTTP_503_SERVICE_UNAVAILABLE).to_response()

    return health


def build_metrics_handler(service: LoraStarService, path: str, include_in_schema: bool) -> Any:
    @get(path, sync_to_thread=False, include_in_schema=include_in_schema, summary="Prometheus metrics")
    def metrics() -> Response[bytes]:
        return Response(service.metrics.render(), status_code=HTTP_200_OK, media_type=CONTENT_TYPE)

    return metrics
