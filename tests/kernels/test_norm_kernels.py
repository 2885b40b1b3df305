"""The one-launch RMSNorm and SiLU-and-mul against their torch references (transformers' arithmetic):
under the Triton interpreter on CPU, and compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from lorastar.kernels.activation import silu_and_mul
from lorastar.kernels.norm import rms_norm
from lorastar.kernels.reference import ref_rms_norm, ref_silu_and_mul

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within the dtype's rounding, and bit-equal almost everywhere: the kernels differ from torch
    only in the order of the fp32 sum and the approximate exp / rsqrt. Triton's interpreter casts
    fp32 to bf16 by truncation (a GPU rounds to nearest), so on CPU bf16 may be off by two steps
    (the normed value and the weight product) and is not held to bit equality."""
    assert got.dtype == want.dtype and got.shape == want.shape
    rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2 if want.is_cuda else 2.4e-2}
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol[want.dtype], atol=1e-5)
    if want.dtype == torch.float16 or (want.is_cuda and want.dtype == torch.bfloat16):
        assert (got == want).float().mean().item() > 0.97


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (7, 576), (33, 1000)])
def test_rms_norm_matches_reference(rows: int, hidden: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    w = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype)
    _check(rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5))


def test_rms_norm_strided_rows_and_refusals() -> None:
    x = torch.randn(6, 96)
    w = torch.randn(32)
    view = x[:, 32:64]  # rows with a stride past their width
    _check(rms_norm(view, w, 1e-6), ref_rms_norm(view, w, 1e-6))
    assert rms_norm(torch.empty(0, 32), w, 1e-6).shape == (0, 32)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(x.t(), torch.randn(6), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inter"), [(1, 64), (5, 1536), (17, 1000)])
def test_silu_and_mul_matches_reference(rows: int, inter: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows + inter)
    x = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
    _check(silu_and_mul(x), ref_silu_and_mul(x))


def test_silu_and_mul_refuses_odd_width() -> None:
    with pytest.raises(ValueError, match=r"\[T, 2N\]"):
        silu_and_mul(torch.randn(2, 7))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_norm_and_activation_gpu(rows: int, dtype: torch.dtype) -> None:
    """Compiled at serving sizes (TinyLlama: hidden 2048, intermediate 5632; 8192-wide rows)."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    for hidden in (2048, 8192):
        x = (torch.randn(rows, hidden, generator=gen, device="cuda") * 3).to(dtype)
        w = (1 + 0.3 * torch.randn(hidden, generator=gen, device="cuda")).to(dtype)
        _check(rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5))
    g = (torch.randn(rows, 2 * 5632, generator=gen, device="cuda") * 4).to(dtype)
    _check(silu_and_mul(g), ref_silu_and_mul(g))
