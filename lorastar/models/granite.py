"""IBM Granite 3.x dense (``GraniteForCausalLM``: Granite 3.0-3.3 2B/8B and their fine-tunes).

What differs from Llama (transformers' Granite modeling is the reference): four scalars from the
config, ``embedding_multiplier`` (the input embeddings times it), ``attention_multiplier`` (the
softmax scale, instead of ``head_dim ** -0.5``), ``residual_multiplier`` (each attention and MLP
output times it before the residual add) and ``logits_scaling`` (the logits divided by it).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from lorastar.forward_context import ForwardContext
from lorastar.layers.rotary import RotaryEmbedding
from lorastar.models.llama import DecoderLayer, LlamaForCausalLM
from lorastar.quant.base import QuantConfig


class GraniteDecoderLayer(DecoderLayer):
    def __init__(
        self,
        cfg: dict[str, Any],
        layer_idx: int,
        dtype: torch.dtype,
        quant: QuantConfig | None,
        rope: RotaryEmbedding,
        sliding_window: int = 0,
    ) -> None:
        super().__init__(cfg, layer_idx, dtype, quant, rope, sliding_window)
        self.residual_multiplier = float(cfg.get("residual_multiplier", 1.0))
        self.self_attn.scale = float(cfg.get("attention_multiplier", 1.0))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(x), ctx)  # [T, hidden]
        x, h = self.post_attention_layernorm.add_forward(x, attn * self.residual_multiplier)
        return x + self.mlp(h, ctx) * self.residual_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    architectures: ClassVar[dict[str, str]] = {"GraniteForCausalLM": "granite"}
    layer_cls: ClassVar[type[nn.Module]] = GraniteDecoderLayer

    def __init__(self, cfg: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(cfg, *args, **kwargs)
        self.embedding_multiplier = float(cfg.get("embedding_multiplier", 1.0))
        self.logits_scaling = float(cfg.get("logits_scaling", 1.0))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling  # [rows, vocab]
