"""OLMo 2 (``Olmo2ForCausalLM``: AI2's fully open 1B-32B models and their fine-tunes).

What differs from Llama (transformers' Olmo2 modeling is the reference):
* norms after each block, not before: ``x = x + post_attention_norm(attn(x))``, then
  ``x = x + post_feedforward_norm(mlp(x))`` (no input norm);
* q and k each normalized over their whole projection (all heads at once), before RoPE;
* the norms multiply by their weight in fp32 and round once (``Olmo2RMSNorm``), where Llama's rounds
  the normalized input to the model's dtype first.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from lorastar.forward_context import ForwardContext
from lorastar.layers.attention import attention_forward
from lorastar.layers.norm import RMSNorm
from lorastar.layers.rotary import RotaryEmbedding
from lorastar.models.llama import MLP, Attention, LlamaForCausalLM
from lorastar.quant.base import QuantConfig


class Olmo2RMSNorm(RMSNorm):
    """``(w * (x / rms(x))).to(x.dtype)`` with the product in fp32. In fp32 that is Llama's norm
    (same arithmetic), so fp32 keeps its fused and C++ forms; other dtypes take the torch form."""

    def _native_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        return super()._native_rows(x) if x.dtype == torch.float32 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


class Olmo2Attention(Attention):
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
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm = Olmo2RMSNorm(self.q_size, eps, dtype)  # type: ignore[assignment]
        self.k_norm = Olmo2RMSNorm(self.kv_size, eps, dtype)  # type: ignore[assignment]

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        qkv = self.qkv_proj(x, ctx)  # [T, q + 2 kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        assert self.q_norm is not None and self.k_norm is not None
        q = self.q_norm(q).view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_norm(k).view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rope(positions, q, k, ctx)
        o = attention_forward(
            q, k, v, ctx, self.layer_idx, self.scale, sliding_window=self.sliding_window, softcap=self.softcap
        )  # [T, Hq, D]
        return self.o_proj(o.reshape(-1, self.q_size), ctx)


class Olmo2DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: dict[str, Any],
        layer_idx: int,
        dtype: torch.dtype,
        quant: QuantConfig | None,
        rope: RotaryEmbedding,
        sliding_window: int = 0,
    ) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = Olmo2Attention(cfg, layer_idx, dtype, quant, rope, sliding_window)
        self.post_attention_layernorm = Olmo2RMSNorm(cfg["hidden_size"], eps, dtype)
        self.mlp = MLP(cfg, layer_idx, dtype, quant)
        self.post_feedforward_layernorm = Olmo2RMSNorm(cfg["hidden_size"], eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, x, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(x, ctx))


class Olmo2ForCausalLM(LlamaForCausalLM):
    architectures: ClassVar[dict[str, str]] = {"Olmo2ForCausalLM": "olmo2"}
    layer_cls: ClassVar[type[nn.Module]] = Olmo2DecoderLayer

    def make_norm(self, size: int, eps: float, dtype: torch.dtype) -> nn.Module:
        return Olmo2RMSNorm(size, eps, dtype)
