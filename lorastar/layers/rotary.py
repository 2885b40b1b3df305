"""Rotary position embedding (default, linear and llama3 scaling), exactly as transformers computes it."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lorastar.forward_context import ForwardContext

SUPPORTED_ROPE = ("default", "llama3", "linear")


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes `rope_parameters` (with rope_theta inside); 4.x wrote `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE)}"
        )
    params["rope_type"] = rope_type
    return params


def rope_inv_freq(cfg: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Inverse frequencies, computed exactly as transformers does for each rope type."""
    p = _rope_parameters(cfg)
    base = float(p["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if p["rope_type"] == "linear":
        inv_freq = inv_freq / float(p["factor"])
    elif p["rope_type"] == "llama3":
        factor = float(p["factor"])
        low_freq_factor = float(p["low_freq_factor"])
        high_freq_factor = float(p["high_freq_factor"])
        old_len = float(p["original_max_position_embeddings"])
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, inv_freq_llama)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: dict[str, Any], head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(cfg, head_dim)  # [head_dim / 2]
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [max_pos, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)  # [max_pos, head_dim]
        self.register_buffer("sin", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].to(dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin[positions].to(dtype)[:, None, :]
        return cos, sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, ctx: ForwardContext | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if ctx is not None and ctx.attn.rope_cos is not None:  # computed once for the step
            cos, sin = ctx.attn.rope_cos, ctx.attn.rope_sin
        else:
            cos, sin = self.cos_sin(positions, q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)
