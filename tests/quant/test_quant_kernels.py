"""Triton int4/int8 GEMM (interpreter on CPU, compiled on a GPU) and the references it is checked
against. The references themselves are checked against an independent packer written the way
AutoAWQ / auto-gptq pack (so the oracle is not just the kernel's own reading of the layout)."""

from __future__ import annotations

import pytest
import torch

from lorastar.kernels import reference as R

triton = pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack order (awq/modules/linear/gemm.py)


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` ints 0..15 -> ``[R, C/8]`` int32, as AutoAWQ's WQLinear_GEMM.from_linear packs."""
    out = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for c in range(q.shape[1] // 8):
        for i in range(8):
            out[:, c] |= q[:, c * 8 + AWQ_ORDER[i]].long() << (i * 4)
    return out.to(torch.int32) if out.max() < 2**31 else (out - (out >= 2**31).long() * 2**32).to(torch.int32)


def pack_gptq_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    per = 32 // bits
    out = torch.zeros(q.shape[0] // per, q.shape[1], dtype=torch.int64)
    for j in range(per):
        out |= q[j::per].long() << (bits * j)
    return (out - (out >= 2**31).long() * 2**32).to(torch.int32)


def pack_gptq_cols(q: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_gptq_rows(q.t().contiguous(), bits).t().contiguous()


def test_awq_reference_matches_autoawq_packing() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 32), generator=g)
    z = torch.randint(0, 16, (2, 32), generator=g)
    s = torch.rand(2, 32, generator=g)
    assert torch.equal(R.ref_awq_unpack(pack_awq(q)), q.int())
    w = R.ref_awq_dequant(pack_awq(q), pack_awq(z), s, group_size=32)
    expect = (q.float() - z.float().repeat_interleave(32, 0)) * s.repeat_interleave(32, 0)
    torch.testing.assert_close(w, expect)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_reference_matches_packing(bits: int) -> None:
    g = torch.Generator().manual_seed(1)
    top = 1 << bits
    q = torch.randint(0, top, (64, 16), generator=g)
    z = torch.randint(0, top - 1, (4, 16), generator=g)
    s = torch.rand(4, 16, generator=g)
    g_idx = torch.randperm(64, generator=g) // 16
    w = R.ref_gptq_dequant(pack_gptq_rows(q, bits), pack_gptq_cols(z, bits), s, g_idx, bits, zero_offset=1)
    expect = (q.float() - (z.float()[g_idx] + 1)) * s[g_idx]
    torch.testing.assert_close(w, expect)


def _rand_i32(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=gen)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_gemm_kernel(group_size: int, dtype: torch.dtype) -> None:
    from lorastar.kernels.quant_gemm import awq_gemm

    gen = torch.Generator().manual_seed(group_size)
    m, k, n = 3, 128, 72  # n not a multiple of the 64-wide tile: exercises the edge mask
    qw, qz = _rand_i32(k, n // 8, gen=gen), _rand_i32(k // group_size, n // 8, gen=gen)
    s = (torch.rand(k // group_size, n, generator=gen) * 0.02).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    ref = R.ref_awq_gemm(x, qw, qz, s, group_size)
    out = awq_gemm(x.to(DEV), qw.to(DEV), qz.to(DEV), s.to(DEV), group_size).cpu()
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))


@pytest.mark.parametrize(
    ("bits", "group_size", "act_order", "zero_offset", "dtype"),
    [
        (4, 32, False, 1, torch.float32),
        (4, 64, False, 0, torch.float16),
        (4, 128, False, 1, torch.float16),
        (4, -1, False, 1, torch.float32),
        (4, 32, True, 1, torch.float32),
        (4, 64, True, 1, torch.float16),
        (8, 32, False, 1, torch.float32),
        (8, -1, False, 1, torch.float16),
        (8, 32, True, 0, torch.float32),
    ],
)
def test_gptq_gemm_kernel(
    bits: int, group_size: int, act_order: bool, zero_offset: int, dtype: torch.dtype
) -> None:
    from lorastar.kernels.quant_gemm import gptq_gemm

    gen = torch.Generator().manual_seed(bits * 1000 + group_size)
    m, k, n = 5, 128, 64
    gs = k if group_size == -1 else group_size
    groups = k // gs
    qw, qz = _rand_i32(k * bits // 32, n, gen=gen), _rand_i32(groups, n * bits // 32, gen=gen)
    s = (torch.rand(groups, n, generator=gen) * (0.02 if bits == 4 else 0.002)).to(dtype)
    g_idx = (torch.randperm(k, generator=gen) // gs if act_order else torch.arange(k) // gs).to(torch.int32)
    x = torch.randn(m, k, generator=gen).to(dtype)
    ref = R.ref_gptq_gemm(x, qw, qz, s, g_idx, bits, zero_offset)
    out = gptq_gemm(
        x.to(DEV),
        qw.to(DEV),
        qz.to(DEV),
        s.to(DEV),
        g_idx.to(DEV) if act_order else None,
        bits,
        gs,
        zero_offset,
    ).cpu()
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))


def test_gemm_kernel_larger_m_and_empty() -> None:
    """Prefill-sized M uses a taller tile; M = 0 returns an empty result without launching."""
    from lorastar.kernels.quant_gemm import awq_gemm

    gen = torch.Generator().manual_seed(7)
    k, n = 64, 64
    qw, qz = _rand_i32(k, n // 8, gen=gen), _rand_i32(k // 32, n // 8, gen=gen)
    s = torch.rand(k // 32, n, generator=gen) * 0.02
    x = torch.randn(40, k, generator=gen)
    out = awq_gemm(x.to(DEV), qw.to(DEV), qz.to(DEV), s.to(DEV), 32).cpu()
    torch.testing.assert_close(out, R.ref_awq_gemm(x, qw, qz, s, 32), atol=1e-4, rtol=1e-4)
    assert awq_gemm(x[:0].to(DEV), qw.to(DEV), qz.to(DEV), s.to(DEV), 32).shape == (0, n)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_gemm_kernel_split_k_and_row_groups(fmt: str) -> None:
    """Split-K (atomic fp32 partial sums, used for decode-sized M on GPUs) and groups smaller than
    a K tile (per-row scale gather)."""
    from lorastar.kernels.quant_gemm import awq_gemm, gptq_gemm

    gen = torch.Generator().manual_seed(11)
    m, k, n, g = 3, 128, 64, 16
    x = torch.randn(m, k, generator=gen)
    s = torch.rand(k // g, n, generator=gen) * 0.02
    if fmt == "awq":
        qw, qz = _rand_i32(k, n // 8, gen=gen), _rand_i32(k // g, n // 8, gen=gen)
        ref = R.ref_awq_gemm(x, qw, qz, s, g)
        outs = [awq_gemm(x.to(DEV), qw.to(DEV), qz.to(DEV), s.to(DEV), g, split_k=sk).cpu() for sk in (1, 2)]
    else:
        qw, qz = _rand_i32(k // 8, n, gen=gen), _rand_i32(k // g, n // 8, gen=gen)
        ref = R.ref_gptq_gemm(x, qw, qz, s, torch.arange(k) // g, 4)
        outs = [
            gptq_gemm(x.to(DEV), qw.to(DEV), qz.to(DEV), s.to(DEV), None, 4, g, split_k=sk).cpu()
            for sk in (1, 2)
        ]
    for out in outs:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
