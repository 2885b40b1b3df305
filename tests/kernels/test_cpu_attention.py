"""The CPU paged decode op (``kernels/cpu_attention.py``, C++) against the plain reference."""

from __future__ import annotations

import shutil

import pytest
import torch

from lorastar.kernels import cpu_attention
from lorastar.kernels.reference import ref_paged_attention


def _op() -> None:
    if cpu_attention.load() is None:
        if shutil.which("g++") and shutil.which("ninja"):
            pytest.fail("g++ and ninja are here but the CPU attention op did not build")
        pytest.skip("no C++ toolchain: the CPU attention op cannot build here")


def _case(
    ctx_lens: list[int], hq: int, hkv: int, d: int, bs: int, window: int, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Decode rows (one new token each) over shuffled blocks of a NaN-poisoned cache; blocks wholly
    before every row's window are -1 in the table (freed) and never read."""
    gen = torch.Generator().manual_seed(seed)
    nb = sum(-(-n // bs) for n in ctx_lens) + 3
    k_cache = torch.full((nb, bs, hkv, d), float("nan"))
    v_cache = k_cache.clone()
    perm = torch.randperm(nb, generator=gen).tolist()
    mb = max(-(-n // bs) for n in ctx_lens)
    tables = torch.full((len(ctx_lens), mb), -1, dtype=torch.int32)
    for b, n in enumerate(ctx_lens):
        lo = max(0, n - window) if window else 0
        for j in range(-(-n // bs)):
            blk = perm.pop()
            tables[b, j] = blk
            k_cache[blk] = torch.randn(bs, hkv, d, generator=gen)
            v_cache[blk] = torch.randn(bs, hkv, d, generator=gen)
        for j in range(lo // bs):  # freed by the block manager: poisoned and unmapped
            k_cache[tables[b, j]] = float("nan")
            v_cache[tables[b, j]] = float("nan")
            tables[b, j] = -1
    # q rows strided, as the model's view into its fused qkv output; row 1 is a prefill row (not ours).
    t = len(ctx_lens) + 1
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen) * 2
    q = qkv[:, : hq * d].view(t, hq, d)
    rows = torch.tensor([0] + list(range(2, t)), dtype=torch.int64)
    return q, k_cache, v_cache, tables, rows


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("d", [64, 24])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (7, 0.0), (0, 5.0), (20, 5.0)])
def test_paged_decode_matches_reference(
    hq: int, hkv: int, bs: int, d: int, window: int, softcap: float
) -> None:
    _op()
    ctx_lens = [1, 5, 16, 17, 40, 3, 33]
    q, k_cache, v_cache, tables, rows = _case(ctx_lens, hq, hkv, d, bs, window)
    lens = torch.tensor(ctx_lens, dtype=torch.int64)
    lo = (lens - window).clamp(min=0) if window else torch.zeros_like(lens)
    first = lo // bs
    nblk = int(((lens + bs - 1) // bs - first).max())
    idx = (first[:, None] + torch.arange(nblk)[None, :]).clamp(max=tables.shape[1] - 1)
    gather = tables.long().gather(1, idx).clamp(min=0).contiguous()
    out = torch.full((q.shape[0], hq, d), 7.0)
    cpu_attention.paged_decode(
        q, k_cache, v_cache, rows, gather, lo, lens, out, scale=d**-0.5, softcap=softcap
    )
    assert torch.equal(out[1], torch.full((hq, d), 7.0))  # a row not in `rows` is left alone
    qd = q[rows]
    ref = ref_paged_attention(
        qd, k_cache, v_cache, tables.clamp(min=0), lens.int(), torch.arange(len(ctx_lens) + 1, dtype=torch.int32),
        scale=d**-0.5, sliding_window=window, softcap=softcap,
    )  # fmt: skip
    torch.testing.assert_close(out[rows], ref, atol=2e-5, rtol=2e-5)


def test_paged_decode_rejects_what_it_cannot_read() -> None:
    _op()
    q, k_cache, v_cache, tables, rows = _case([5, 9], 4, 2, 16, 4, 0)
    lens, lo = torch.tensor([5, 9]), torch.zeros(2, dtype=torch.int64)
    gather = tables.long().clamp(min=0)
    out = torch.empty(q.shape[0], 4, 16)
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_attention.paged_decode(q.half(), k_cache, v_cache, rows, gather, lo, lens, out, scale=1.0)
    with pytest.raises(RuntimeError, match="int64"):
        cpu_attention.paged_decode(q, k_cache, v_cache, rows.int(), gather, lo, lens, out, scale=1.0)
