"""lorastar's Litestar plugin: OpenAI-compatible serving of one base model and its LoRA adapters.

>>> from litestar import Litestar
>>> from lorastar.plugin import LoraStarPlugin, LoraStarConfig
>>> app = Litestar(route_handlers=[...], plugins=[LoraStarPlugin(LoraStarConfig(adapters={"pirate": "adapters/pirate"}))])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lorastar.plugin.config import LoraStarConfig
    from lorastar.plugin.errors import APIError
    from lorastar.plugin.plugin import LoraStarPlugin, create_app, lifespan

__all__ = ["APIError", "LoraStarConfig", "LoraStarPlugin", "create_app", "lifespan"]

_LAZY = {
    "APIError": "lorastar.plugin.errors",
    "LoraStarConfig": "lorastar.plugin.config",
    "LoraStarPlugin": "lorastar.plugin.plugin",
    "create_app": "lorastar.plugin.plugin",
    "lifespan": "lorastar.plugin.plugin",
}


def __getattr__(name: str) -> Any:
    """Lazy, as ``lorastar``'s own names: ``lorastar lora ...`` (``plugin/cli.py``, an HTTP client)
    then starts without importing torch (2.4 -> 0.2 s a command here)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lorastar.plugin' has no attribute {name!r}")
