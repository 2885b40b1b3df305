"""Exceptions lorastar raises across its public boundary (the plugin maps them to HTTP); imports nothing."""

from __future__ import annotations


class LoraStarError(Exception):
    """Base class of lorastar's own errors."""


class InvalidParamError(LoraStarError, ValueError):
    """A request field is invalid. ``param`` names the field (as the caller spelled it, when
    known): the HTTP layer reports it as the OpenAI error's ``param`` without parsing messages."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


class LimitExceededError(InvalidParamError):
    """A request is over one of the server's configured limits (``EngineConfig``'s ``max_*``)."""


class AdapterError(LoraStarError, ValueError):
    """An adapter could not be loaded or validated; the registry is unchanged."""


class AdapterExistsError(AdapterError):
    """A load of a new adapter found its name taken (vLLM's "has already been loaded"): the check is
    the engine's, so workers sharing one core cannot both load the name."""


class AdapterNotFoundError(LoraStarError, KeyError):
    """A request or command named an adapter that is not registered (or is being unloaded)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "adapter not found"


class EngineOverloadedError(LoraStarError):
    """The waiting queue is over its bound (``EngineConfig.max_waiting``); retry later."""


class EngineDeadError(LoraStarError):
    """The engine's step loop has died and could not be rebuilt; no new request can be served."""


class EngineUnavailableError(LoraStarError):
    """The engine is restarting after a failed step; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestFailedError(LoraStarError):
    """A step that included this request failed; the engine restarts without it (the request
    is not retried: it may be the cause). Streams get it as an in-band error."""


class StartupCancelled(RuntimeError):
    """The wait for an engine core was ended (``core_client.cancel_startup()``: a signal while an
    app's startup waited for a shared core; or its client's ``shutdown``)."""
