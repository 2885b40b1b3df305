"""Paged attention Triton kernels (interpreter on CPU) and the cache write vs the plain reference."""

from __future__ import annotations

import pytest
import torch

from lorastar.kernels.paged_attention import paged_attention, reshape_and_cache
from lorastar.kernels.reference import ref_paged_attention, ref_reshape_and_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_BLOCKS = 24

# (context already cached, new tokens) per sequence. Lengths straddle block boundaries (16/32).
DECODE = [(16, 1), (0, 1), (40, 1), (70, 1)]
MIXED = [(0, 19), (31, 1), (15, 6), (0, 1), (33, 17)]  # fresh prefill, decode, chunked prefill


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-4, "rtol": 2e-4} if dtype == torch.float32 else {"atol": 3e-3, "rtol": 3e-3}


def _build(
    seqs: list[tuple[int, int]],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    seed: int = 0,
    num_blocks: int = NUM_BLOCKS,
) -> dict:
    """Random sequences written into a NaN-poisoned cache through shuffled block tables."""
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)  # a read of an unwritten slot -> NaN
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # non-contiguous, shuffled blocks
    max_blocks = max((c + q + block_size - 1) // block_size for c, q in seqs) + 1
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    slots, keys, values, qs, qsl, seq_lens = [], [], [], [], [0], []
    for b, (ctx, q_len) in enumerate(seqs):
        total = ctx + q_len
        nblk = (total + block_size - 1) // block_size
        block_tables[b, :nblk] = torch.tensor([perm.pop() for _ in range(nblk)], dtype=torch.int32)
        for pos in range(total):
            slots.append(int(block_tables[b, pos // block_size]) * block_size + pos % block_size)
        keys.append(torch.randn(total, num_kv_heads, head_dim, generator=gen))
        values.append(torch.randn(total, num_kv_heads, head_dim, generator=gen))
        qs.append(torch.randn(q_len, num_q_heads, head_dim, generator=gen))
        qsl.append(qsl[-1] + q_len)
        seq_lens.append(total)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    reshape_and_cache(
        torch.cat(keys).to(dtype),
        torch.cat(values).to(dtype),
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
    )
    d = {
        "q": torch.cat(qs).to(dtype),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "query_start_loc": torch.tensor(qsl, dtype=torch.int32),
    }
    d = {k: v.to(DEVICE) for k, v in d.items()}
    d["max_query_len"] = max(q for _, q in seqs)
    d["max_seq_len"] = max(seq_lens)
    return d


def _run(d: dict, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
    scale = d["q"].shape[-1] ** -0.5
    args = (d["q"], d["k_cache"], d["v_cache"], d["block_tables"], d["seq_lens"], d["query_start_loc"])
    common = {"scale": scale, "max_query_len": d["max_query_len"], "max_seq_len": d["max_seq_len"]}
    out = torch.full_like(d["q"], float("nan"))  # every row must be written
    got = paged_attention(*args, **common, out=out, **kw)  # type: ignore[arg-type]
    ref_kw = {k: v for k, v in kw.items() if k != "num_splits"}  # a kernel-only knob
    ref = ref_paged_attention(*args, **common, **ref_kw)  # type: ignore[arg-type]
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(got).any()
    return got, ref


# (seqs, Hq, Hkv, head_dim, block_size, dtype): GQA/MHA, block 16/32, head dim 32/64, fp32/fp16.
CASES = [
    ("decode", DECODE, 4, 1, 32, 16, torch.float32),
    ("decode", DECODE, 4, 2, 64, 16, torch.float16),
    ("decode", DECODE, 2, 2, 64, 32, torch.float32),
    ("decode", DECODE, 8, 2, 32, 32, torch.float16),
    ("mixed", MIXED, 4, 1, 64, 16, torch.float32),
    ("mixed", MIXED, 4, 2, 32, 16, torch.float16),
    ("mixed", MIXED, 2, 2, 32, 32, torch.float32),
    ("mixed", MIXED, 4, 2, 64, 32, torch.float16),
]


@pytest.mark.parametrize(
    ("kind", "seqs", "hq", "hkv", "head_dim", "block_size", "dtype"),
    CASES,
    ids=[f"{c[0]}-h{c[2]}/{c[3]}-d{c[4]}-bs{c[5]}-{str(c[6])[6:]}" for c in CASES],
)
def test_paged_attention(
    kind: str,
    seqs: list[tuple[int, int]],
    hq: int,
    hkv: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> None:
    d = _build(seqs, hq, hkv, head_dim, block_size, dtype)
    got, ref = _run(d)
    torch.testing.assert_close(got, ref, **_tol(dtype))


@pytest.mark.parametrize("num_splits", [2, 3])
def test_decode_split_k(num_splits: int) -> None:
    # Split-K over the context merges partial softmaxes; short sequences leave later splits empty.
    d = _build([(70, 1), (5, 1), (33, 1)], 4, 2, 32, 16, torch.float32, seed=1)
    got, ref = _run(d, num_splits=num_splits)
    torch.testing.assert_close(got, ref, **_tol(torch.float32))


@pytest.mark.parametrize(
    ("cache_dtype", "kind"), [(torch.float8_e4m3fn, "decode"), (torch.float8_e5m2, "mixed")]
)
def test_fp8_cache(cache_dtype: torch.dtype, kind: str) -> None:
    seqs = DECODE if kind == "decode" else MIXED[:3]
    d = _build(seqs, 4, 2, 32, 16, torch.float16, cache_dtype=cache_dtype, k_scale=0.5, v_scale=0.25, seed=2)
    got, ref = _run(d, k_scale=0.5, v_scale=0.25)
    torch.testing.assert_close(got, ref, **_tol(torch.float16))


def _free_outside_window(d: dict, window: int) -> None:
    """Point every block-table entry wholly before all of a row's windows at a never-written
    (NaN) block, as if the block manager had freed it: a kernel that reads one returns NaN."""
    bs = d["k_cache"].shape[1]
    used = set(d["block_tables"].flatten().tolist())
    poison = next(b for b in range(d["k_cache"].shape[0]) if b not in used)
    qsl, lens = d["query_start_loc"].tolist(), d["seq_lens"].tolist()
    for b, L in enumerate(lens):
        first_needed = max(0, L - (qsl[b + 1] - qsl[b]) - window + 1)  # first row's window start
        d["block_tables"][b, : first_needed // bs] = poison


# Sequences several windows long; chunks that start inside, at and before the window.
WINDOW_DECODE = [(70, 1), (5, 1), (40, 1), (16, 1)]
WINDOW_MIXED = [(0, 50), (70, 1), (33, 17), (3, 9), (45, 30)]


@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("window", [1, 7, 16, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sliding_window(kind: str, window: int, dtype: torch.dtype) -> None:
    seqs = WINDOW_DECODE if kind == "decode" else WINDOW_MIXED
    d = _build(seqs, 4, 2, 32, 16, dtype, seed=4, num_blocks=40)
    _free_outside_window(d, window)
    got, ref = _run(d, sliding_window=window)
    torch.testing.assert_close(got, ref, **_tol(dtype))


@pytest.mark.parametrize("num_splits", [2, 3])
def test_sliding_window_split_k(num_splits: int) -> None:
    d = _build(WINDOW_DECODE, 4, 2, 32, 16, torch.float32, seed=5, num_blocks=40)
    _free_outside_window(d, 40)
    got, ref = _run(d, sliding_window=40, num_splits=num_splits)
    torch.testing.assert_close(got, ref, **_tol(torch.float32))


@pytest.mark.parametrize("kind", ["decode", "mixed"])
@pytest.mark.parametrize("window", [0, 16])
def test_softcap(kind: str, window: int) -> None:
    seqs = WINDOW_DECODE if kind == "decode" else WINDOW_MIXED
    d = _build(seqs, 4, 2, 32, 16, torch.float32, seed=6, num_blocks=40)
    d["q"] = d["q"] * 8  # large scores, so the cap bends them
    got, ref = _run(d, softcap=5.0, sliding_window=window)
    torch.testing.assert_close(got, ref, **_tol(torch.float32))
    plain, _ = _run(d, sliding_window=window)
    assert not torch.allclose(got, plain, atol=1e-2)  # the cap changed the result


def test_paged_attention_strided_q() -> None:
    # q as a column slice of a fused qkv projection (non-contiguous rows).
    d = _build(MIXED[:3], 4, 2, 32, 16, torch.float32, seed=3)
    t = d["q"].shape[0]
    qkv = torch.randn(t, 8 * 32, device=DEVICE)
    qkv[:, : 4 * 32] = d["q"].reshape(t, -1)
    d["q"] = qkv[:, : 4 * 32].view(t, 4, 32)
    got, ref = _run(d)
    torch.testing.assert_close(got, ref, **_tol(torch.float32))


# ---------------------------------------------------------------------------------------------
# reshape_and_cache
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reshape_and_cache(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(10, 2, 32, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(10, 2, 32, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(4 * 16, generator=gen)[:10].to(DEVICE)
    caches = [torch.randn(4, 16, 2, 32, generator=gen).to(dtype).to(DEVICE) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    reshape_and_cache(key, value, caches[0], caches[1], slots)
    ref_reshape_and_cache(key, value, ref_caches[0], ref_caches[1], slots)
    torch.testing.assert_close(caches[0], ref_caches[0], rtol=0, atol=0)
    torch.testing.assert_close(caches[1], ref_caches[1], rtol=0, atol=0)
    blk, off = slots // 16, slots % 16
    torch.testing.assert_close(caches[0][blk, off], key, rtol=0, atol=0)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_reshape_and_cache_fp8_round_trip(cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    key = (torch.randn(12, 2, 32, generator=gen) * 3).to(DEVICE)
    value = (torch.randn(12, 2, 32, generator=gen) * 3).to(DEVICE)
    key[0, 0, 0] = 1e5  # beyond e4m3's and e5m2's range after scaling: saturates instead of NaN
    slots = torch.randperm(3 * 16, generator=gen)[:12].to(DEVICE)
    k_cache = torch.zeros(3, 16, 2, 32, device=DEVICE).to(cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    k_scale, v_scale = 0.5, 0.25
    reshape_and_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    ref_reshape_and_cache(key, value, ref_k, ref_v, slots, k_scale, v_scale)
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))
    blk, off = slots // 16, slots % 16
    k_back = k_cache[blk, off].float() * k_scale
    v_back = v_cache[blk, off].float() * v_scale
    assert not torch.isnan(k_back).any()
    assert k_back[0, 0, 0] == torch.finfo(cache_dtype).max * k_scale
    rel = 2.0**-3 if cache_dtype == torch.float8_e4m3fn else 2.0**-2  # mantissa bits 3 / 2
    mask = torch.ones_like(key, dtype=torch.bool)
    mask[0, 0, 0] = False
    assert ((k_back - key).abs() <= rel * key.abs() + 1e-2)[mask].all()
    assert ((v_back - value).abs() <= rel * value.abs() + 1e-2).all()


# ---------------------------------------------------------------------------------------------
# GPU only: real compilation at serving sizes, bf16 (broken in the interpreter)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kind", ["decode", "mixed", "long_decode"])
def test_paged_attention_gpu(kind: str, head_dim: int, dtype: torch.dtype) -> None:
    if kind == "decode":
        seqs = [(int(c), 1) for c in torch.randint(1, 300, (24,)).tolist()]
    elif kind == "long_decode":  # few sequences, long context: the split-K path
        seqs = [(1500, 1), (2000, 1)]
    else:
        seqs = [(0, 200), (100, 1), (250, 70), (0, 1), (37, 129)]
    d = _build(seqs, 32, 8, head_dim, 16, dtype, num_blocks=1000)
    got, ref = _run(d)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_fp8_cache_gpu() -> None:
    d = _build(
        DECODE, 32, 8, 128, 16, torch.bfloat16, cache_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=0.5
    )
    got, ref = _run(d, k_scale=0.5, v_scale=0.5)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_decode_compiles_once_for_any_split_count() -> None:
    """Every split count (1 with short contexts or many sequences, several with long contexts and
    few) runs on one compiled decode kernel and one reduce: no JIT compile in mid-serving when a
    new batch size or context length comes along."""
    from lorastar.kernels import paged_attention as pa

    dev = torch.cuda.current_device()
    cached = lambda fn: len(fn.device_caches[dev][0])  # noqa: E731 - compiled variants on this device
    before = cached(pa._decode_kernel), cached(pa._decode_reduce_kernel)
    for seqs, splits in [([(40, 1)], 1), ([(1500, 1)], None), ([(900, 1), (60, 1)], 3), ([(2000, 1)], 7)]:
        d = _build(seqs, 32, 8, 128, 16, torch.bfloat16, num_blocks=300)
        got, ref = _run(d, num_splits=splits)
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert cached(pa._decode_kernel) - before[0] <= 1
    assert cached(pa._decode_reduce_kernel) - before[1] <= 1
