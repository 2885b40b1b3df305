"""HTTP errors in the OpenAI/vLLM shape: ``{"error": {"message", "type", "param", "code"}}``.

Every exception that reaches a plugin route ends up here, so a client never sees a bare 500 with a
traceback. Engine exceptions map to statuses once, in :func:`to_api_error`.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.status_codes import (
    HTTP_400_BAD_REQUEST,
    HTTP_401_UNAUTHORIZED,
    HTTP_403_FORBIDDEN,
    HTTP_404_NOT_FOUND,
    HTTP_500_INTERNAL_SERVER_ERROR,
    HTTP_503_SERVICE_UNAVAILABLE,
)

from lorastar.errors import AdapterError, AdapterNotFoundError, EngineDeadError, EngineOverloadedError

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

_FIELD_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\b")
# Engine-side names of request fields -> the wire field a client sent.
_PARAM_ALIASES = {"prompt_token_ids": "prompt", "sampling_params": None, "request_id": None}


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


def param_from_message(message: str, known: set[str] | frozenset[str] | None = None) -> str | None:
    """The field a ``ValueError`` message starts with (the engine's convention), if it is a known one."""
    m = _FIELD_RE.match(message)
    if not m:
        return None
    name = m.group(1)
    if name in _PARAM_ALIASES:
        return _PARAM_ALIASES[name]
    if known is not None and name not in known:
        return None
    return name


def _validation_param(exc: ValidationException) -> tuple[str, str | None]:
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
            return f"{msg} (field '{key}')" if key not in str(msg) else str(msg), str(key)
        return str(msg), None
    return str(exc.detail), None


def to_api_error(
    exc: BaseException, *, retry_after: int = 1, known_params: frozenset[str] | None = None
) -> APIError:
    """Map any exception to the API error it should be answered with."""
    if isinstance(exc, APIError):
        return exc
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
    if isinstance(exc, AdapterError):
        return APIError(str(exc), HTTP_400_BAD_REQUEST, param=param_from_message(str(exc), known_params))
    if isinstance(exc, ValidationException):
        message, param = _validation_param(exc)
        return APIError(message, HTTP_400_BAD_REQUEST, param=param)
    if isinstance(exc, HTTPException):
        status = exc.status_code
        if status >= 500:
            return APIError("Internal server error.", status, headers=dict(exc.headers or {}))
        return APIError(str(exc.detail), status, headers=dict(exc.headers or {}))
    if isinstance(exc, ValueError):
        return APIError(str(exc), HTTP_400_BAD_REQUEST, param=param_from_message(str(exc), known_params))
    logger.exception("lorastar: unexpected error", exc_info=exc)
    return APIError("Internal server error.", HTTP_500_INTERNAL_SERVER_ERROR)


def make_exception_handler(retry_after: int, known_params: frozenset[str] | None = None) -> Any:
    def handler(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        return to_api_error(exc, retry_after=retry_after, known_params=known_params).to_response()

    return handler


def unauthorized(message: str = "Unauthorized") -> APIError:
    return APIError(message, HTTP_401_UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})


def forbidden(message: str, param: str | None = None) -> APIError:
    return APIError(message, HTTP_403_FORBIDDEN, param=param)


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(message, HTTP_404_NOT_FOUND, param=param)
