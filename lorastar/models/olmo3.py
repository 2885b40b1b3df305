"""OLMo 3 (``Olmo3ForCausalLM``: AI2's fully open 7B and 32B, Base / Instruct / Think).

OLMo 2's layers (``models/olmo2.py``) with local and global layers: three of every four attend through
a sliding window (``layer_types``), and each layer type has its own RoPE (``rope_parameters`` nested
by layer type; the long-context YaRN applies to the global layers only), as Gemma 3 nests them.

transformers applies OLMo 3's cos/sin in fp32 without rounding them to the model's dtype first; here
they are rounded as for every other family, which changes nothing in fp32 and rounds q and k once more
in bf16 (near ties may differ there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from lorastar.forward_context import ForwardContext
from lorastar.layers.embedding import EmbeddingMethod
from lorastar.layers.rotary import RotaryEmbedding
from lorastar.models.olmo2 import Olmo2ForCausalLM
from lorastar.quant.base import QuantConfig


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    architectures: ClassVar[dict[str, str]] = {"Olmo3ForCausalLM": "olmo3"}

    @classmethod
    def text_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """``config.json`` completed with transformers' ``Olmo3Config`` defaults: ``layer_types`` (three
        sliding layers in four), ``rope_parameters`` per layer type (base 500,000; a top-level
        ``rope_scaling`` goes to the global layers)."""
        from transformers import Olmo3Config

        fields = {k: v for k, v in cfg.items() if k != "quantization_config"}  # read as it is, below
        full = Olmo3Config(**fields).to_dict()
        return {
            **cfg,
            **{k: full[k] for k in ("layer_types", "rope_parameters", "sliding_window")},
            "rope_scaling": None,
        }

    def __init__(
        self,
        cfg: dict[str, Any],
        dtype: torch.dtype,
        quant: QuantConfig | None,
        max_positions: int,
        embedding_method: Callable[[], EmbeddingMethod] | None = None,
    ) -> None:
        self._max_positions = max_positions
        self._ropes: dict[str, RotaryEmbedding] = {}
        super().__init__(cfg, dtype, quant, max_positions, embedding_method)
        self.local_rope = self._ropes.get("sliding_attention")  # registered as submodules

    def _rope_for(self, cfg: dict[str, Any], layer_type: str) -> RotaryEmbedding:
        if layer_type not in self._ropes:
            params = cfg["rope_parameters"][layer_type]
            self._ropes[layer_type] = RotaryEmbedding(
                {**cfg, "rope_parameters": params}, self.head_dim, self._max_positions
            )
        return self._ropes[layer_type]

    def make_rope(self, cfg: dict[str, Any], max_positions: int) -> RotaryEmbedding:
        return self._rope_for(cfg, "full_attention")

    def make_layer(
        self,
        cfg: dict[str, Any],
        layer_idx: int,
        dtype: torch.dtype,
        quant: QuantConfig | None,
        rope: RotaryEmbedding,
        sliding_window: int,
    ) -> nn.Module:
        rope = self._rope_for(cfg, cfg["layer_types"][layer_idx])
        return super().make_layer(cfg, layer_idx, dtype, quant, rope, sliding_window)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed(input_ids)  # [T, hidden]
        # Two RoPEs (local / global): each layer reads its own table (no step-wide cos/sin).
        ctx.attn.rope_cos = ctx.attn.rope_sin = None
        for layer in self.layers:
            x = layer(positions, x, ctx)
        return self.norm(x)
