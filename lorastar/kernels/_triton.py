"""Helpers shared by the kernels: Triton when installed, the device's SM count, FP8 dtypes."""

from __future__ import annotations

import functools

import torch

try:  # Triton is optional on CPU-only installs (e.g. non-Linux); the torch paths still work.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton ships with the Linux install
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

__all__ = ["FP8_DTYPES", "HAS_TRITON", "is_fp8", "num_sms", "tl", "triton"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


@functools.lru_cache(maxsize=8)
def _sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (cached: asked per op per layer per step);
    1 elsewhere (the interpreter: fewer programs is faster)."""
    if device.type == "cuda":
        return _sms_of(device.index if device.index is not None else torch.cuda.current_device())
    return 1
