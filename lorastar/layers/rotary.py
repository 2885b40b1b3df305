"""Rotary position embedding (default, linear, dynamic NTK, llama3, YaRN and longrope scaling; partial
rotary), exactly as transformers computes it.

LongRoPE (Phi-3 / Phi-4-mini): transformers switches between the short and the long factors on the
length of the whole forward, so one sequence's cached keys can carry the short factors and its later
ones the long. A paged cache cannot recompute old keys, so the choice is made once per engine, as vLLM
does: the long factors when the engine's ``max_model_len`` exceeds ``original_max_position_embeddings``,
else the short ones. Both match transformers on any sequence that stays on one side of that length.

Dynamic NTK: transformers recomputes the base from each forward's length once it passes
``max_position_embeddings`` (below it, plain RoPE). With ``max_model_len`` within the original context
(the default) it is plain RoPE, exactly; past it, the base is fixed for ``factor`` times the original
context, as vLLM does (``DynamicNTKScalingRotaryEmbedding``): transformers' forward agrees at that
length only, so the engine warns (``dynamic_ntk_past_context``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lorastar.forward_context import ForwardContext
from lorastar.kernels import cpu_native

SUPPORTED_ROPE = ("default", "dynamic", "llama3", "linear", "longrope", "yarn")


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes `rope_parameters` (with rope_theta inside); 4.x wrote `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("su", "yarn") and "short_factor" in params:  # Phi-3's older spellings of longrope
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE)}"
        )
    params["rope_type"] = rope_type
    return params


def _original_max_positions(p: dict[str, Any], cfg: dict[str, Any]) -> int:
    """The pretraining context of a scaled RoPE (llama3, yarn, longrope), as transformers'
    ``standardize_rope_params`` sets it: a top-level ``original_max_position_embeddings`` (Phi-3 writes
    it there) over the RoPE parameters' own, else ``max_position_embeddings`` (a hand-written
    ``rope_scaling`` may omit it)."""
    return int(
        cfg.get("original_max_position_embeddings")
        or p.get("original_max_position_embeddings")
        or cfg["max_position_embeddings"]
    )


def rotary_dim(cfg: dict[str, Any], head_dim: int) -> int:
    """Dimensions of each head that rotate (``partial_rotary_factor`` < 1: the first ones only)."""
    p = _rope_parameters(cfg)
    factor = float(p.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    return int(head_dim * factor)


def dynamic_ntk_past_context(cfg: dict[str, Any], max_positions: int | None) -> bool:
    """A dynamic-NTK RoPE served past ``max_position_embeddings``: its base is fixed for ``factor``
    times that context (vLLM's form), where transformers would recompute it for each length."""
    p = _rope_parameters(cfg)
    return (
        p["rope_type"] == "dynamic"
        and max_positions is not None
        and max_positions > int(cfg["max_position_embeddings"])
    )


def rope_inv_freq(
    cfg: dict[str, Any], head_dim: int, max_positions: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling ("attention factor"), computed exactly as
    transformers does for each rope type. ``max_positions``: the engine's longest sequence (longrope
    picks its factors from it, see the module docstring)."""
    p = _rope_parameters(cfg)
    base = float(p["rope_theta"])
    dim = rotary_dim(cfg, head_dim)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = 1.0
    if p["rope_type"] == "longrope":
        orig = _original_max_positions(p, cfg)
        factor = p.get("factor") or cfg["max_position_embeddings"] / orig
        scaling = p.get("attention_factor")
        if scaling is None:
            scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        long = max_positions is not None and max_positions > orig
        ext = torch.tensor(p["long_factor"] if long else p["short_factor"], dtype=torch.float32)
        inv_freq = 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    elif p["rope_type"] == "linear":
        inv_freq = inv_freq / float(p["factor"])
    elif p["rope_type"] == "dynamic" and dynamic_ntk_past_context(cfg, max_positions):
        orig, factor = int(cfg["max_position_embeddings"]), float(p["factor"])
        seq_len = orig * factor  # vLLM's fixed length; transformers' base formula at that length
        base = base * ((factor * seq_len / orig) - (factor - 1)) ** (dim / (dim - 2))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    elif p["rope_type"] == "yarn":
        inv_freq, scaling = _yarn(p, cfg, inv_freq, dim, base)
    elif p["rope_type"] == "llama3":
        factor = float(p["factor"])
        low_freq_factor = float(p["low_freq_factor"])
        high_freq_factor = float(p["high_freq_factor"])
        old_len = float(_original_max_positions(p, cfg))
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, inv_freq_llama)
    return inv_freq, float(scaling)


def _yarn(
    p: dict[str, Any], cfg: dict[str, Any], inv_freq: torch.Tensor, dim: int, base: float
) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen3's and Qwen2.5's long-context setting, Ministral 3): each frequency blends its
    interpolated (/ factor) and original value on a linear ramp between the dimensions that turn
    ``beta_fast`` and ``beta_slow`` times over the original context; cos/sin scaled by the attention
    factor ``0.1 ln(factor) + 1`` (or its mscale / mscale_all_dim ratio). transformers'
    ``_compute_yarn_parameters``, step for step."""
    orig = _original_max_positions(p, cfg)
    factor = float(p["factor"])  # required (transformers 5 refuses a yarn config without it)

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    scaling = p.get("attention_factor")
    if scaling is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            scaling = mscale_of(factor, mscale) / mscale_of(factor, mscale_all_dim)
        else:
            scaling = mscale_of(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # [dim / 2]: 1 keeps the original frequency, 0 interpolates it
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)  # 1 / inv_freq
    interpolation = 1.0 / (factor * pos_freqs)  # rounded as transformers rounds it, not inv_freq / factor
    return interpolation * (1 - extrapolation) + inv_freq * extrapolation, float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: dict[str, Any], head_dim: int, max_positions: int) -> None:
        super().__init__()
        self._cfg, self._head_dim = cfg, head_dim
        self._inv_freq, cos, sin = self._tables(max_positions, max_positions)
        self.rotary_dim = cos.shape[1]  # < head_dim: partial rotary (the rest passes through)
        self.register_buffer("cos", cos, persistent=False)  # [max_pos, rotary_dim]
        self.register_buffer("sin", sin, persistent=False)
        # fp32 / bf16 CPU heads through the C++ op (kernels/cpu_native.py), set by use_native_cpu_ops: one
        # pass where the torch form is five ops, 8.7 vs 75 us for SmolLM2's 12 heads at 64 rows.
        self.native_cpu = False

    def _tables(self, rows: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inverse frequencies for an engine of ``max_len`` positions, and ``rows`` rows of cos/sin."""
        inv_freq, scaling = rope_inv_freq(self._cfg, self._head_dim, max_len)  # [rotary_dim / 2]
        pos = torch.arange(rows, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [rows, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return inv_freq, emb.cos() * scaling, emb.sin() * scaling  # [rows, rotary_dim] each

    def fit_to(self, max_len: int) -> bool:
        """Re-pick what depends on the engine's length (longrope's factors, dynamic NTK's base) once
        the engine's ``max_model_len`` ended below the length the model was built for (a KV cache
        too small for it). The tables keep their size and storage. True where they changed."""
        inv_freq, cos, sin = self._tables(self.cos.shape[0], max_len)
        if torch.equal(inv_freq, self._inv_freq):
            return False
        self._inv_freq = inv_freq
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        return True

    def use_native_cpu_ops(self) -> None:
        self.native_cpu = True

    def _native(self, x: torch.Tensor, cos: torch.Tensor) -> bool:
        return (
            self.native_cpu and x.dtype == cos.dtype and x.dtype in cpu_native.DTYPES and x.device.type == "cpu"
            and x.dim() == 3 and x.stride(2) == 1 and self.rotary_dim == x.shape[-1] and cos.is_contiguous()
        )  # fmt: skip

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].to(dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin[positions].to(dtype)[:, None, :]
        return cos, sin

    def _step_cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, ctx: ForwardContext | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if ctx is not None and ctx.attn.rope_cos is not None:  # computed once for the step
            return ctx.attn.rope_cos, ctx.attn.rope_sin
        return self.cos_sin(positions, dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, ctx: ForwardContext | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._step_cos_sin(positions, q.dtype, ctx)
        if self._native(q, cos) and self._native(k, cos) and sin.is_contiguous():
            return cpu_native.rotary(q, cos, sin), cpu_native.rotary(k, cos, sin)
        r = self.rotary_dim
        if r == q.shape[-1]:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        q_rot = q[..., :r] * cos + _rotate_half(q[..., :r]) * sin
        k_rot = k[..., :r] * cos + _rotate_half(k[..., :r]) * sin
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)

    def rotate(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext | None = None
    ) -> torch.Tensor:
        """Full-width rotary over ``x [T, H, D]`` (q and k heads side by side: one pass for both,
        10.9 vs 20.6 us for SmolLM2's 9 + 3 heads at 10 rows)."""
        cos, sin = self._step_cos_sin(positions, x.dtype, ctx)
        if self._native(x, cos) and sin.is_contiguous():
            return cpu_native.rotary(x, cos, sin)
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)
