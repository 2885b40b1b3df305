"""The CPU elementwise ops (``kernels/cpu_native.py``, ``csrc/cpu_elementwise.cpp``) against the plain
references: RMSNorm (alone and after a residual add), SiLU-and-mul, rotary. They round differently
from torch (another summation order, a polynomial exp), so the bounds are a few ulp of the values."""

from __future__ import annotations

import pytest
import torch

from lorastar.kernels import cpu_native
from lorastar.kernels.reference import ref_rms_norm, ref_rotary, ref_silu_and_mul
from tests.kernels.test_cpu_native import _op

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _rows(n: int, d: int, gen: torch.Generator, strided: bool, scale: float = 1.0) -> torch.Tensor:
    """``[n, d]`` fp32; ``strided``: a column slice of wider rows (a view of a fused projection)."""
    if not strided:
        return torch.randn(n, d, generator=gen) * scale
    return (torch.randn(n, d + 24, generator=gen) * scale)[:, 8 : 8 + d]


@pytest.mark.parametrize("n", [1, 7, 64, 300])
@pytest.mark.parametrize("d", [16, 100, 576])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_and_add_rms_norm_match_reference(n: int, d: int, strided: bool) -> None:
    _op()
    gen = torch.Generator().manual_seed(n * 1000 + d)
    x, h = _rows(n, d, gen, strided, 3.0), _rows(n, d, gen, strided)
    w, eps = torch.randn(d, generator=gen), 1e-5
    torch.testing.assert_close(cpu_native.rms_norm(x, w, eps), ref_rms_norm(x, w, eps), **TOL)
    s, normed = cpu_native.add_rms_norm(x, h, w, eps)
    torch.testing.assert_close(s, x + h, atol=0, rtol=0)  # one rounding, as torch's add
    torch.testing.assert_close(normed, ref_rms_norm(x + h, w, eps), **TOL)
    assert s.is_contiguous() and normed.is_contiguous() and normed.shape == (n, d)


@pytest.mark.parametrize("n", [1, 5, 64])
@pytest.mark.parametrize("inter", [8, 100, 1536])
@pytest.mark.parametrize("strided", [False, True])
def test_silu_and_mul_matches_reference(n: int, inter: int, strided: bool) -> None:
    _op()
    gen = torch.Generator().manual_seed(n * 7 + inter)
    gu = _rows(n, 2 * inter, gen, strided, 4.0)
    torch.testing.assert_close(cpu_native.silu_and_mul(gu), ref_silu_and_mul(gu), **TOL)


def test_silu_and_mul_at_the_edges_of_exp() -> None:
    """Gates far past exp's range (clamped inside the op), zeros and NaN behave as torch's."""
    _op()
    g = torch.tensor([-1000.0, -100.0, -88.5, -87.5, -20.0, -1e-30, 0.0, 1e-30, 20.0, 87.5, 88.5, 100.0, 1e6])
    gu = torch.cat([g, torch.full_like(g, 1.5)])[None]
    torch.testing.assert_close(cpu_native.silu_and_mul(gu), ref_silu_and_mul(gu), atol=1e-30, rtol=1e-6)
    nan = torch.tensor([[float("nan"), 1.0, 2.0, 2.0]])
    assert cpu_native.silu_and_mul(nan)[0, 0].isnan() and not cpu_native.silu_and_mul(nan)[0, 1].isnan()


@pytest.mark.parametrize("t", [1, 9, 64])
@pytest.mark.parametrize(("h", "d"), [(1, 16), (12, 64), (5, 128)])
def test_rotary_matches_reference_on_a_view_of_fused_qkv(t: int, h: int, d: int) -> None:
    _op()
    gen = torch.Generator().manual_seed(t * 31 + d)
    qkv = torch.randn(t, (h + 2) * d, generator=gen)
    x = qkv[:, : h * d].view(t, h, d)  # the q (and k) heads of a fused projection: strided rows
    pos = torch.randint(0, 4000, (t,), generator=gen).float()
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)  # [t, d]
    cos, sin = ang.cos(), ang.sin()
    out = cpu_native.rotary(x, cos[:, None, :], sin[:, None, :])  # the engine passes [T, 1, D]
    torch.testing.assert_close(out, ref_rotary(x, cos, sin), **TOL)
    assert out.is_contiguous() and out.shape == (t, h, d)


def test_elementwise_ops_refuse_what_they_cannot_read() -> None:
    _op()
    x, w = torch.randn(4, 16), torch.randn(16)
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_native.rms_norm(x.double(), w, 1e-6)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        cpu_native.rms_norm(x.t(), w, 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_native.rms_norm(x, torch.randn(8), 1e-6)
    with pytest.raises(RuntimeError, match="one shape"):
        cpu_native.add_rms_norm(x, torch.randn(3, 16), w, 1e-6)
    with pytest.raises(RuntimeError, match="even number"):
        cpu_native.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="cos and sin"):
        cpu_native.rotary(torch.randn(2, 3, 16), torch.randn(2, 8), torch.randn(2, 8))


def test_each_row_rounds_the_same_at_any_address_and_batch() -> None:
    """Bit-identical rows wherever they sit: shifted by 1-15 floats in memory (the sums of squares
    run in lanes by index, never grouped by address) and alone or among 63 others (the rows a thread
    gets). Greedy tokens must not depend on how a step batched its rows."""
    _op()
    gen = torch.Generator().manual_seed(5)
    d, inter, h, hd = 576, 1536, 12, 64
    x, r = torch.randn(64, d, generator=gen) * 3, torch.randn(64, d, generator=gen)
    gu = torch.randn(64, 2 * inter, generator=gen) * 4
    qk = torch.randn(64, h, hd, generator=gen)
    cos, sin = torch.randn(64, hd, generator=gen), torch.randn(64, hd, generator=gen)
    w = torch.randn(d, generator=gen)

    def shifted(t: torch.Tensor, k: int) -> torch.Tensor:  # the same values k floats further on
        buf = torch.empty(t.numel() + 16)
        out = buf[k : k + t.numel()].view(t.shape)
        out.copy_(t)
        return out

    want = (
        cpu_native.rms_norm(x, w, 1e-5), *cpu_native.add_rms_norm(x, r, w, 1e-5),
        cpu_native.silu_and_mul(gu), cpu_native.rotary(qk, cos, sin),
    )  # fmt: skip
    for k in range(1, 16):
        got = (
            cpu_native.rms_norm(shifted(x, k), w, 1e-5),
            *cpu_native.add_rms_norm(shifted(x, k), shifted(r, k), w, 1e-5),
            cpu_native.silu_and_mul(shifted(gu, k)), cpu_native.rotary(shifted(qk, k), cos, sin),
        )  # fmt: skip
        for a, b in zip(got, want):
            assert torch.equal(a, b), f"a shift of {k} floats changed the result"
    for i in (0, 17, 63):
        one = (
            cpu_native.rms_norm(x[i : i + 1], w, 1e-5), cpu_native.add_rms_norm(x[i : i + 1], r[i : i + 1], w, 1e-5)[1],
            cpu_native.silu_and_mul(gu[i : i + 1]), cpu_native.rotary(qk[i : i + 1], cos[i : i + 1], sin[i : i + 1]),
        )  # fmt: skip
        for a, b in zip(one, (want[0], want[2], want[3], want[4])):
            assert torch.equal(a[0], b[i])


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between ``a`` and ``b`` (bf16) in units of bf16's last place."""
    ia = a.view(torch.int16).int()
    ib = b.view(torch.int16).int()
    ia = torch.where(ia < 0, -32768 - ia, ia)  # sign-magnitude -> ordered ints
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return int((ia - ib).abs().max())


@pytest.mark.parametrize("n", [1, 7, 64])
@pytest.mark.parametrize("strided", [False, True])
def test_bf16_ops_round_as_torchs_bf16_forms(n: int, strided: bool) -> None:
    """bf16 rows, computed in fp32 and rounded where torch's composite bf16 forms round: the add and
    rotary bit for bit, the norm and SiLU within one bf16 ulp (their fp32 values differ by a few fp32
    ulp: another summation order, a polynomial exp), and almost every value equal."""
    _op()
    gen = torch.Generator().manual_seed(n + 100 * strided)
    d, inter, h, hd = 576, 1536, 12, 64
    x, r = _rows(n, d, gen, strided, 3.0).bfloat16(), _rows(n, d, gen, strided).bfloat16()
    w = torch.randn(d, generator=gen).bfloat16()
    gu = _rows(n, 2 * inter, gen, strided, 4.0).bfloat16()
    qkv = torch.randn(n, (h + 2) * hd, generator=gen).bfloat16()
    q = qkv[:, : h * hd].view(n, h, hd)
    cos, sin = torch.randn(n, hd, generator=gen).bfloat16(), torch.randn(n, hd, generator=gen).bfloat16()

    got = cpu_native.rms_norm(x, w, 1e-5)
    want = ref_rms_norm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16 and _bf16_ulps(got, want) <= 1
    assert (got != want).float().mean() < 0.01
    s, normed = cpu_native.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, x + r) and _bf16_ulps(normed, ref_rms_norm(x + r, w, 1e-5)) <= 1
    got = cpu_native.silu_and_mul(gu)
    want = ref_silu_and_mul(gu)
    assert got.dtype == torch.bfloat16 and _bf16_ulps(got, want) <= 1
    assert (got != want).float().mean() < 0.01
    assert torch.equal(cpu_native.rotary(q, cos[:, None, :], sin[:, None, :]), ref_rotary(q, cos, sin))


def test_bf16_ops_refuse_mixed_dtypes() -> None:
    _op()
    x = torch.randn(4, 16).bfloat16()
    with pytest.raises(RuntimeError, match="x's dtype"):
        cpu_native.rms_norm(x, torch.randn(16), 1e-6)  # an fp32 weight for bf16 rows
    with pytest.raises(RuntimeError, match="one shape and dtype"):
        cpu_native.add_rms_norm(x, x.float(), torch.randn(16).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="x's dtype"):
        cpu_native.rotary(torch.randn(2, 3, 16).bfloat16(), torch.randn(2, 16), torch.randn(2, 16))
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        cpu_native.silu_and_mul(torch.randn(2, 8).half())
