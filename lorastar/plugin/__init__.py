"""lorastar's Litestar plugin: OpenAI-compatible serving of one base model and its LoRA adapters.

>>> from litestar import Litestar
>>> from lorastar.plugin import LoraStarPlugin, LoraStarConfig
>>> app = Litestar(route_handlers=[...], plugins=[LoraStarPlugin(LoraStarConfig(adapters={"pirate": "adapters/pirate"}))])
"""

from __future__ import annotations

from lorastar.plugin.config import LoraStarConfig
from lorastar.plugin.errors import APIError
from lorastar.plugin.plugin import LoraStarPlugin, create_app, lifespan

__all__ = ["APIError", "LoraStarConfig", "LoraStarPlugin", "create_app", "lifespan"]
