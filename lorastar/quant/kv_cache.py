"""FP8 KV cache: the cache dtype and the per-layer K/V scales.

The cache stores ``k / k_scale`` (``v / v_scale``) in e4m3 or e5m2; the attention kernels multiply
back. Scales come from the checkpoint when it carries them (compressed-tensors ``kv_cache_scheme``:
``model.layers.{i}.self_attn.k_scale`` / ``v_scale``), else they are 1.0 (e4m3 covers +-448, far
beyond typical K/V magnitudes) or computed by ``compute_kv_scale`` from observed values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

# llm-compressor writes self_attn.{k,v}_scale; older releases wrote {k,v}_proj.output_scale; vLLM's
# own checkpoints self_attn.attn.{k,v}_scale. The one parser of KV-scale names (the loader uses it).
_KV_SCALE_KEY = re.compile(
    r"^(?:.*\.)?layers\.(\d+)\.self_attn\.(?:attn\.)?(?:(k|v)_scale|(k|v)_proj\.output_scale)$"
)


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """``"auto"`` -> the model dtype; ``"fp8"``/``"fp8_e4m3"`` -> e4m3; ``"fp8_e5m2"`` -> e5m2."""
    if kv_cache_dtype == "auto":
        return model_dtype
    try:
        return KV_CACHE_DTYPES[kv_cache_dtype]
    except KeyError:
        raise ValueError(
            f"kv_cache_dtype must be 'auto', 'fp8', 'fp8_e4m3' or 'fp8_e5m2', got {kv_cache_dtype!r}"
        ) from None


def is_fp8_kv(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in KV_CACHE_DTYPES


def parse_kv_scale_key(key: str) -> tuple[int, str] | None:
    """``model.layers.3.self_attn.k_scale`` -> ``(3, "k")``; ``None`` for any other tensor name."""
    m = _KV_SCALE_KEY.match(key)
    if m is None:
        return None
    return int(m.group(1)), (m.group(2) or m.group(3))


def compute_kv_scale(values: torch.Tensor, kv_cache_dtype: str) -> float:
    """A scale that maps the observed ``amax`` onto the fp8 range (``amax / finfo.max``)."""
    dtype = kv_cache_torch_dtype(kv_cache_dtype, torch.float32)
    amax = float(values.detach().abs().amax().float()) if values.numel() else 0.0
    return max(amax / float(torch.finfo(dtype).max), 1e-12) if amax > 0 else 1.0


@dataclass
class KVScales:
    """Per-layer scales collected while loading (the loader feeds every checkpoint tensor whose
    name ``parse_kv_scale_key`` recognises) and resolved once the model is loaded."""

    num_layers: int
    k: dict[int, float] = field(default_factory=dict)
    v: dict[int, float] = field(default_factory=dict)

    def add(self, key: str, tensor: torch.Tensor) -> bool:
        """Record ``tensor`` if ``key`` is a KV scale; returns whether it was one."""
        parsed = parse_kv_scale_key(key)
        if parsed is None:
            return False
        layer, which = parsed
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"{key}: layer {layer} out of range (model has {self.num_layers} layers)")
        if tensor.numel() != 1:
            raise ValueError(f"{key}: expected one per-tensor scale, got shape {tuple(tensor.shape)}")
        value = float(tensor.float().reshape(()))
        if not value > 0:
            raise ValueError(f"{key}: scale must be positive, got {value}")
        (self.k if which == "k" else self.v)[layer] = value
        return True

    @property
    def from_checkpoint(self) -> bool:
        return bool(self.k or self.v)

    def resolve(self, kv_cache_dtype: str) -> tuple[list[float], list[float]]:
        """``(k_scales, v_scales)``, one float per layer.

        Unquantized caches always use 1.0 (the scales only matter for fp8). With fp8, a checkpoint
        that carries scales must carry them for every layer (a partial set is a broken checkpoint)."""
        ones = [1.0] * self.num_layers
        if not is_fp8_kv(kv_cache_dtype) or not self.from_checkpoint:
            return ones, list(ones)
        missing = [
            f"model.layers.{i}.self_attn.{which}_scale"
            for i in range(self.num_layers)
            for which, d in (("k", self.k), ("v", self.v))
            if i not in d
        ]
        if missing:
            more = f" (and {len(missing) - 4} more)" if len(missing) > 4 else ""
            raise ValueError(f"{', '.join(missing[:4])}{more}: missing from the checkpoint")
        return [self.k[i] for i in range(self.num_layers)], [self.v[i] for i in range(self.num_layers)]


def resolve_kv_scales(
    kv_cache_dtype: str, num_layers: int, checkpoint_tensors: dict[str, torch.Tensor] | None = None
) -> tuple[list[float], list[float]]:
    """One-shot form of ``KVScales``: scales from the given tensors (any extra keys are ignored)."""
    scales = KVScales(num_layers)
    for key, t in (checkpoint_tensors or {}).items():
        scales.add(key, t)
    return scales.resolve(kv_cache_dtype)
