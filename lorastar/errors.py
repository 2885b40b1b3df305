"""Exceptions lorastar raises across its public boundary (the plugin maps them to HTTP); imports nothing."""

from __future__ import annotations


class LoraStarError(Exception):
    """Base class of lorastar's own errors."""


class AdapterError(LoraStarError, ValueError):
    """An adapter could not be loaded or validated; the registry is unchanged."""


class AdapterNotFoundError(LoraStarError, KeyError):
    """A request or command named an adapter that is not registered (or is being unloaded)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "adapter not found"


class EngineOverloadedError(LoraStarError):
    """The waiting queue is over its bound (``EngineConfig.max_waiting``); retry later."""


class EngineDeadError(LoraStarError):
    """The engine's step loop has died; no new request can be served."""
