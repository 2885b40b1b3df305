"""RMSNorm, computed in fp32 and cast back (as transformers' Llama does), and Gemma's ``(1 + w)`` variant."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lorastar.kernels import cpu_native
from lorastar.kernels._triton import HAS_TRITON
from lorastar.kernels.norm import MAX_ROW, rms_norm

HALF = (torch.bfloat16, torch.float16)


def native_rows(x: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor | None:
    """``x`` as the C++ norm's ``[N, D]`` rows (a CPU tensor of one of ``dtypes`` whose rows it can
    read), or None."""
    if x.dtype not in dtypes or x.device.type != "cpu":
        return None
    if x.dim() == 2 and x.stride(1) == 1:
        return x
    return x.view(-1, x.shape[-1]) if x.is_contiguous() else None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        # fp32 / bf16 CPU rows through the C++ op (kernels/cpu_native.py), set by use_native_cpu_ops: one
        # pass where torch's CPU rms_norm is six ops, 5.8 vs 34 us at 64 rows of SmolLM2, 1.9 vs 14 at 1.
        self.native_cpu = False

    def use_native_cpu_ops(self) -> None:
        self.native_cpu = True

    def _native_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x`` as the C++ op's ``[N, D]`` rows, or None where it does not apply."""
        if not (self.native_cpu and x.dtype == self.weight.dtype):
            return None
        return native_rows(x, cpu_native.DTYPES)

    def add_forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + h, self(x + h))``: a residual add and the norm after it, one pass on the C++ path."""
        rows, hrows = self._native_rows(x), self._native_rows(h)
        if rows is not None and hrows is not None and x.dim() == 2 and x.shape == h.shape:
            return cpu_native.add_rms_norm(rows, hrows, self.weight, self.eps)
        s = x + h
        return s, self(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        rows = self._native_rows(x)
        if rows is not None:
            return cpu_native.rms_norm(rows, self.weight, self.eps).view(x.shape)
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op, the same arithmetic (bit-identical here): 8.8 vs 12.4 us at 10 rows.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        if (
            x.is_cuda and HAS_TRITON and dtype in HALF and self.weight.dtype == dtype
            and x.dim() == 2 and x.shape[1] <= MAX_ROW and x.stride(1) == 1
        ):  # fmt: skip
            return rms_norm(x, self.weight, self.eps)  # one launch instead of eight
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as ``w - 1`` and multiplies in fp32 before the cast back
    (transformers' Gemma2/Gemma3RMSNorm; Llama casts first, then multiplies)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        # fp32 CPU rows through the C++ rms_norm with ``1 + w`` as its weight (the same products in
        # the same order; only the sum of squares rounds differently, by a few ulp), set by
        # use_native_cpu_ops once the weight is loaded. Gemma has six norms a layer (two on q/k heads,
        # strided views: torch's form); bf16 keeps torch's form too, since Gemma rounds once, after the
        # weight, where the op rounds before it.
        self.plus_one: torch.Tensor | None = None

    def use_native_cpu_ops(self) -> None:
        if self.weight.dtype == torch.float32 and self.weight.device.type == "cpu":
            self.plus_one = (1.0 + self.weight.detach()).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = None if self.plus_one is None else native_rows(x, (torch.float32,))
        if rows is not None:
            return cpu_native.rms_norm(rows, self.plus_one, self.eps).view(x.shape)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
