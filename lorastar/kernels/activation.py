"""Gated-MLP activation in one launch on CUDA: ``silu(gate) * up`` read from the fused gate/up
projection's output, rounded as torch rounds it (the SiLU to the input dtype, then the product)."""

from __future__ import annotations

import torch

from lorastar.kernels._triton import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def _silu_and_mul_kernel(
        x_ptr, out_ptr, N, stride_x, stride_o,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)  # F.silu in x's dtype
        out = act.to(tl.float32) * up.to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Semantics: ``F.silu(x[:, :N]) * x[:, N:]`` with ``N = x.shape[1] // 2``.

    Args:
        x: ``[T, 2 * N]`` gate then up (last dimension contiguous).
    Returns ``[T, N]`` in ``x``'s dtype.
    """
    if not HAS_TRITON:
        raise RuntimeError("silu_and_mul needs Triton (pip install triton)")
    t, n2 = x.shape
    if n2 % 2 or x.stride(1) != 1:
        raise ValueError(
            f"silu_and_mul takes [T, 2N] rows, contiguous in the last dimension, got {tuple(x.shape)}"
        )
    n = n2 // 2
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block = min(triton.next_power_of_2(n), 1024)
    _silu_and_mul_kernel[(t, triton.cdiv(n, block))](x, out, n, x.stride(0), out.stride(0), BLOCK=block)
    return out
