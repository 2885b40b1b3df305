"""Helpers shared by the quantization methods."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

import torch

# Bound on the temporary dequantized tile on the CPU path (elements): no full-precision copy of a
# layer is ever kept, and even the per-call temporary stays small for big layers.
_CHUNK_ELEMS = 1 << 24


def unfused_prefixes(prefix: str, packed: Mapping[str, Sequence[str]]) -> list[str]:
    """``model.layers.0.self_attn.qkv_proj`` -> the q/k/v module names (``packed``: the model's
    ``packed_modules_mapping``); other prefixes unchanged."""
    head, _, last = prefix.rpartition(".")
    parts = packed.get(last)
    if parts is None:
        return [prefix]
    return [f"{head}.{p}" if head else p for p in parts]


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    # Plain names match a whole dotted component run (vLLM/transformers convention).
    return name == pattern or name.endswith("." + pattern) or ("." + pattern + ".") in ("." + name + ".")


def is_skipped(prefix: str, skip: list[str], packed: Mapping[str, Sequence[str]]) -> bool:
    """Whether the layer at ``prefix`` is left unquantized by the checkpoint's ignore list.

    A fused layer must have all of its parts skipped or none (a mix cannot be served fused); a list
    that names the fused module itself (checkpoints that store it fused: Phi-3's ``qkv_proj``) skips it."""
    if not skip:
        return False
    parts = unfused_prefixes(prefix, packed)
    flags = [any(_matches(p, s) for s in skip) for p in parts]
    if not any(flags) and parts != [prefix]:
        return any(_matches(prefix, s) for s in skip)
    if any(flags) and not all(flags):
        raise ValueError(f"{prefix}: the checkpoint quantizes only some of {parts}; cannot fuse them")
    return all(flags)


def adopt_scales_dtype(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Keep group scales in the checkpoint's own float dtype (fp16 for AutoAWQ / GPTQ): the weight is
    dequantized in that dtype, exactly as the tools that wrote it do (and as transformers runs it)."""
    if (
        loaded.dtype.is_floating_point
        and loaded.element_size() > 1
        and loaded.dtype != param.dtype
        and not getattr(param, "loaded_shards", None)
    ):
        param.data = param.data.to(loaded.dtype)


def matmul_dequant_chunked(
    x: torch.Tensor,  # [M, K]
    n_out: int,
    align: int,
    dequant: Callable[[int, int], torch.Tensor],  # (lo, hi) -> W[:, lo:hi] as [K, hi - lo]
) -> torch.Tensor:
    """``x @ W`` where ``W`` is dequantized a block of output columns at a time."""
    k = x.shape[1]
    step = max(align, (_CHUNK_ELEMS // max(k, 1)) // align * align)
    if step >= n_out:
        return x @ dequant(0, n_out)
    out = torch.empty(x.shape[0], n_out, dtype=x.dtype, device=x.device)
    for lo in range(0, n_out, step):
        hi = min(n_out, lo + step)
        out[:, lo:hi] = x @ dequant(lo, hi)
    return out
