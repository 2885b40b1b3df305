"""SmolLM3 (``SmolLM3ForCausalLM``, SmolLM3-3B and its fine-tunes): Llama's decoder with NoPE layers.

What differs from Llama (transformers' SmolLM3 modeling is the reference): ``no_rope_layers[i]`` is 0
for a layer that applies no rotary embedding at all (by default every fourth, from
``no_rope_layer_interval``); a sliding window, where ``use_sliding_window`` sets one, applies only to
those NoPE layers (``layer_types``). The RoPE base defaults to 2,000,000, not Llama's 10,000.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from lorastar.layers.rotary import RotaryEmbedding
from lorastar.models.llama import LlamaForCausalLM, transformers_defaults
from lorastar.quant.base import QuantConfig


class SmolLM3ForCausalLM(LlamaForCausalLM):
    architectures: ClassVar[dict[str, str]] = {"SmolLM3ForCausalLM": "smollm3"}

    @classmethod
    def text_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """``config.json`` completed with transformers' ``SmolLM3Config`` defaults: ``no_rope_layers``
        and ``layer_types`` derived as transformers derives them, the RoPE base its 2,000,000."""
        return {**transformers_defaults(cfg, "SmolLM3Config"), **cfg}

    def make_layer(
        self,
        cfg: dict[str, Any],
        layer_idx: int,
        dtype: torch.dtype,
        quant: QuantConfig | None,
        rope: RotaryEmbedding,
        sliding_window: int,
    ) -> nn.Module:
        layer = super().make_layer(cfg, layer_idx, dtype, quant, rope, sliding_window)
        layer.self_attn.use_rope = bool(cfg["no_rope_layers"][layer_idx])
        return layer
