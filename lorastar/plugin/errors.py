"""HTTP errors in the OpenAI/vLLM shape: ``{"error": {"message", "type", "param", "code"}}``.

Every exception that reaches a plugin route ends up here, so a client never sees a bare 500 with a
traceback. Engine exceptions map to statuses once, in :func:`to_api_error`.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.exceptions.responses import create_exception_response
from litestar.openapi import ResponseSpec
from litestar.status_codes import (
    HTTP_400_BAD_REQUEST,
    HTTP_401_UNAUTHORIZED,
    HTTP_403_FORBIDDEN,
    HTTP_404_NOT_FOUND,
    HTTP_500_INTERNAL_SERVER_ERROR,
    HTTP_503_SERVICE_UNAVAILABLE,
)

from lorastar.errors import (
    AdapterError,
    AdapterNotFoundError,
    EngineDeadError,
    EngineOverloadedError,
    EngineUnavailableError,
    InvalidParamError,
    LoraStarError,
    RequestFailedError,
)
from lorastar.plugin.schemas import UNSUPPORTED_FIELDS

logger = logging.getLogger("lorastar.plugin")

# vLLM's error "type" per status (the openai client picks its exception class from the status).
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class APIError(Exception):
    """An error the plugin answers with the OpenAI error body."""

    def __init__(
        self,
        message: str,
        status_code: int = HTTP_400_BAD_REQUEST,
        *,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.type = type or _TYPES.get(
            status_code, "BadRequestError" if status_code < 500 else "InternalServerError"
        )
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorInfo(self.message, self.type, self.param, self.status_code))

    def to_response(self) -> Response[Any]:
        return Response(
            self.body(), status_code=self.status_code, headers=self.headers, media_type="application/json"
        )


def _validation_param(exc: ValidationException, body: bytes | None = None) -> tuple[str, str | None]:
    if (
        "Number out of range" in f"{exc.detail} {exc.extra}"
    ):  # msgspec stops before it knows the field: find it ourselves
        field = _non_finite_field(body)
        return (
            f"{field} must be a finite number." if field else "A number in the body is out of range."
        ), field
    extra = exc.extra
    if isinstance(extra, list) and extra:
        first = extra[0] if isinstance(extra[0], dict) else {}
        key = first.get("key")
        msg = first.get("message") or exc.detail
        if key in (None, "", "data"):  # the body as a whole: the field is named in msgspec's message
            m = re.search(r"field `([^`]+)`", str(msg))
            key = m.group(1) if m else None
        elif isinstance(key, str) and key.startswith("data."):
            key = key[len("data.") :]
        if key:
            field = re.split(r"[.\[]", str(key), maxsplit=1)[0]  # param: the top-level field
            if (why := UNSUPPORTED_FIELDS.get(field)) is not None:  # a vLLM feature lorastar lacks
                return f"{field}{why}", field
            return f"{msg} (field '{key}')" if key not in str(msg) else str(msg), field
        if msg in ("'data'", "data", ""):  # no body, or not a JSON object at all
            return "The request body must be a JSON object.", None
        return str(msg), None
    return str(exc.detail), None


def _non_finite_field(body: bytes | None) -> str | None:
    """The top-level key holding a number JSON cannot represent as a float (``1e999``)."""
    if not body:
        return None
    try:
        obj = json.loads(body)  # Python's parser reads 1e999 as inf
    except (ValueError, RecursionError):
        return None
    if isinstance(obj, dict):
        for key, value in obj.items():
            if _has_non_finite(value):
                return str(key)
    return None


def _has_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_non_finite(v) for v in value)
    return False


_LEADING_PATH = re.compile(r"^/[^\n]*?(?=: )")  # the engine's "<folder>: <problem>"
_QUOTED_PATH = re.compile(r"(['\"])(/[^'\"\n]+)\1")  # OSError's "...: '/a/b'"
_BARE_PATH = re.compile(r"(?<![\w.:/~-])/[^\s'\":]+")


_ADAPTER_FILES = (".json", ".safetensors", ".bin", ".pt", ".pth")


def hide_paths(message: str) -> str:
    """``message`` with each absolute server path cut to its last part (the folder name, as
    ``/v1/models`` shows a folder outside the adapter root; an adapter's file with its folder, which
    names the adapter)."""

    def name(path: str) -> str:
        parts = [p for p in path.rstrip("/").split("/") if p]
        if len(parts) > 1 and parts[-1].endswith(_ADAPTER_FILES):
            return "/".join(parts[-2:])
        return parts[-1] if parts else "."

    message = _LEADING_PATH.sub(lambda m: name(m.group(0)), message)
    message = _QUOTED_PATH.sub(lambda m: m.group(1) + name(m.group(2)) + m.group(1), message)
    return _BARE_PATH.sub(lambda m: name(m.group(0)), message)


def to_api_error(
    exc: BaseException,
    *,
    retry_after: int = 1,
    body: bytes | None = None,
) -> APIError:
    """Map any exception to the API error it should be answered with."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidParamError):
        return APIError(str(exc), HTTP_400_BAD_REQUEST, param=exc.param)
    if isinstance(exc, (EngineUnavailableError, RequestFailedError)):
        wait = max(retry_after, math.ceil(getattr(exc, "retry_after", 0)))
        return APIError(str(exc), HTTP_503_SERVICE_UNAVAILABLE, headers={"Retry-After": str(wait)})
    if isinstance(exc, RecursionError):  # e.g. JSON nested thousands deep
        return APIError("The request body is nested too deeply.", HTTP_400_BAD_REQUEST)
    if isinstance(exc, AdapterNotFoundError):
        return APIError(str(exc), HTTP_404_NOT_FOUND, param="model")
    if isinstance(exc, EngineOverloadedError):
        return APIError(
            str(exc) or "The engine is overloaded; retry later.",
            HTTP_503_SERVICE_UNAVAILABLE,
            headers={"Retry-After": str(retry_after)},
        )
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc) or "The engine is dead.", HTTP_503_SERVICE_UNAVAILABLE)
    if isinstance(exc, AdapterError):  # e.g. a disk-tier adapter whose folder is gone: no server paths
        return APIError(hide_paths(str(exc)), HTTP_400_BAD_REQUEST)
    if isinstance(exc, ValidationException):
        message, param = _validation_param(exc, body)
        return APIError(message, HTTP_400_BAD_REQUEST, param=param)
    if isinstance(exc, HTTPException):
        status = exc.status_code
        if status >= 500:
            return APIError("Internal server error.", status, headers=dict(exc.headers or {}))
        if "Number out of range" in str(exc.detail):  # JSON parsing stops before it knows the field
            field = _non_finite_field(body)
            message = (
                f"{field} must be a finite number." if field else "A number in the body is out of range."
            )
            return APIError(message, status, param=field)
        return APIError(str(exc.detail), status, headers=dict(exc.headers or {}))
    if isinstance(exc, ValueError) and not isinstance(exc, UnicodeEncodeError):
        return APIError(str(exc), HTTP_400_BAD_REQUEST)
    # (UnicodeEncodeError: a response that could not be encoded, the server's fault, not the client's)
    logger.exception("lorastar: unexpected error", exc_info=exc)
    return APIError("Internal server error.", HTTP_500_INTERNAL_SERVER_ERROR)


def make_exception_handler(
    retry_after: int, render: Callable[[APIError], Response[Any]] = APIError.to_response
) -> Any:
    """Every exception as an ``APIError`` (``to_api_error``), answered by ``render`` (OpenAI's shape
    unless an API of another shape passes its own)."""

    def handler(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        body = None
        if isinstance(exc, HTTPException) and exc.status_code == 400:  # the body was read to parse it
            cached = getattr(getattr(request, "_connection_state", None), "body", None)
            body = cached if isinstance(cached, bytes) else None
        return render(to_api_error(exc, retry_after=retry_after, body=body))

    return handler


# Statuses our routes answer themselves: router-level entries beat the app's own handlers (status
# codes are looked up before exception classes), so the plugin's routes always speak their API's errors.
OWN_STATUSES = (400, 401, 403, 404, 405, 409, 413, 415, 422, 429, 500, 503)


def handler_map(handler: Any) -> dict[Any, Any]:
    """``handler`` for every exception class and status the plugin's routes answer themselves."""
    classes = (Exception, APIError, LoraStarError, ValueError, HTTPException, ValidationException)
    return {**dict.fromkeys(classes, handler), **dict.fromkeys(OWN_STATUSES, handler)}


def app_path(scope: Any) -> str:
    """The path an app routes on: ``scope["path"]`` less ``root_path`` (uvicorn's ``--root-path``,
    Starlette's ``Mount`` and Ray Serve's ``route_prefix`` put the prefix in both)."""
    path, root = scope["path"], (scope.get("root_path") or "").rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root) :] or "/"
    return str(path)


def scoped_handler(prefixes: tuple[str, ...], handler: Any, fallback: Any) -> Any:
    """An app-level handler for 404/405: OpenAI errors under the plugin's paths (unknown routes
    and wrong methods never reach a route, so the router's handlers do not see them); the
    app's own handling (``fallback``, else Litestar's default) everywhere else."""

    def scoped(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        path = app_path(request.scope)  # (``request.url.path`` repeats a root_path)
        if any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes):
            return handler(request, exc)  # type: ignore[no-any-return]
        if fallback is not None:
            return fallback(request, exc)  # type: ignore[no-any-return]
        return create_exception_response(request, exc)

    return scoped


def error_responses(*statuses: int) -> dict[int, ResponseSpec]:
    """OpenAPI entries for the error statuses a route can answer, all in the OpenAI shape."""
    return {
        s: ResponseSpec(data_container=ErrorResponse, description=_DESCRIPTIONS.get(s, _TYPES.get(s, "")))
        for s in statuses
    }


_DESCRIPTIONS = {
    400: "Invalid request: `error.param` names the field",
    401: "Missing or wrong bearer token",
    403: "Path outside the adapter root, or runtime loading disabled",
    404: "Unknown model (base or adapter) or route",
    413: "Request body too large",
    503: "Engine overloaded or restarting (see Retry-After)",
}


def unauthorized(message: str = "Unauthorized") -> APIError:
    return APIError(message, HTTP_401_UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})


def forbidden(message: str, param: str | None = None) -> APIError:
    return APIError(message, HTTP_403_FORBIDDEN, param=param)


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(message, HTTP_404_NOT_FOUND, param=param)
