"""Quantization interface, vLLM's split: ``QuantConfig.from_config`` reads a checkpoint's
``quantization_config``; ``get_linear_method`` gives each linear layer a ``QuantMethod`` (the
method base classes live in ``layers/linear.py``: quant imports layers, never the reverse).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from lorastar.checkpoint_keys import KeyMap
from lorastar.layers.linear import QuantMethod


class QuantConfig(ABC):
    """A checkpoint's quantization scheme; one instance per model."""

    name: str = ""
    packed_modules_mapping: Mapping[str, Sequence[str]] = MappingProxyType({})
    """Fused layer -> the checkpoint modules it is made of (``qkv_proj`` -> q/k/v): the model sets
    its class's mapping here before asking for linear methods, so skip lists name either."""
    key_map: KeyMap = KeyMap()
    """The model's checkpoint -> served renames (``language_model.model.`` -> ``model.``), set with
    ``packed_modules_mapping``: layer names in a config are the checkpoint's."""
    devices: tuple[str, ...] | None = None
    """Device types the scheme runs on (``None``: any); the engine checks before loading."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantConfig:
        """Build from the ``quantization_config`` dict of ``config.json``."""

    @abstractmethod
    def get_linear_method(self, prefix: str) -> QuantMethod:
        """The method for the linear layer at ``prefix`` (e.g. ``model.layers.0.self_attn.qkv_proj``)."""
