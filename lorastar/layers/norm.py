"""RMSNorm, computed in fp32 and cast back (as transformers' Llama does), and Gemma's ``(1 + w)`` variant."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lorastar.kernels._triton import HAS_TRITON
from lorastar.kernels.norm import MAX_ROW, rms_norm

HALF = (torch.bfloat16, torch.float16)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
