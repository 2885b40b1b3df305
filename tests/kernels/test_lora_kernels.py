"""Punica-style multi-LoRA: the Triton kernels (interpreter on CPU) over slot runs, and the CPU
path (``add_lora_cpu``), against the plain references.

Mixed ranks in one batch throughout: slot ``s`` has rank ``max(1, R >> (s % 3))`` (R, R/2, R/4).
"""

from __future__ import annotations

import pytest
import torch

from lorastar.forward_context import LoRAMetadata, lora_ranges, slot_runs
from lorastar.kernels import cpu_native
from lorastar.kernels.lora import compact_row_tiles, lora_expand, lora_shrink
from lorastar.kernels.reference import (
    ref_lora_expand,
    ref_lora_expand_runs,
    ref_lora_shrink,
    ref_lora_shrink_runs,
)
from lorastar.layers.lora import CpuLoRAPlan, add_lora_cpu, build_cpu_lora_plan, cpu_lora_plan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN = 64  # small: every interpreted Triton program costs ~0.2 ms
OUT_DIM = 48  # not a multiple of the N tile: exercises the masked edge
NUM_SLOTS = 4
RANKS = [1, 8, 16, 33, 64]
BATCHES = [1, 5, 16]
DTYPES = [torch.float32, torch.float16]
POPULARITY = ["distinct", "uniform", "zipf", "identical", "skewed"]
WIDTHS = [40, 16, 24]  # a fused linear's slice widths (40: a slice boundary inside an N tile)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def _slot_ranks(max_rank: int, num_slots: int) -> torch.Tensor:
    return torch.tensor([max(1, max_rank >> (s % 3)) for s in range(num_slots)], dtype=torch.int32)


def _token_slots(popularity: str, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Slot per token for a popularity pattern, and the number of slots it needs."""
    if popularity == "distinct":
        return torch.arange(batch, dtype=torch.int32), max(batch, 1)
    if popularity == "identical":
        return torch.full((batch,), 2, dtype=torch.int32), NUM_SLOTS
    if popularity == "uniform":
        probs = torch.ones(NUM_SLOTS)
    elif popularity == "zipf":
        probs = 1.0 / torch.arange(1, NUM_SLOTS + 1, dtype=torch.float32) ** 1.5
    elif popularity == "skewed":
        probs = torch.tensor([0.85] + [0.15 / (NUM_SLOTS - 1)] * (NUM_SLOTS - 1))
    else:
        raise ValueError(popularity)
    slots = torch.multinomial(probs, batch, replacement=True, generator=gen).to(torch.int32)
    slots[1::4] = -1  # some tokens without an adapter
    return slots, NUM_SLOTS


def _ranges(token_slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """Each slot's rows, as the runner builds them (``token_slots`` sorted by slot)."""
    return lora_ranges([(s, 1) for s in token_slots.tolist()])


def _case(
    rank: int, batch: int, dtype: torch.dtype, popularity: str, seed: int = 0
) -> dict[str, torch.Tensor]:
    """One slice per slot at its rank, rows in any order (the CPU path's per-token semantics)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank * 31 + batch)
    token_slots, num_slots = _token_slots(popularity, batch, gen)
    ranks = _slot_ranks(rank, num_slots)
    a = torch.randn(num_slots, rank, HIDDEN, generator=gen) * 0.1
    b = torch.randn(num_slots, OUT_DIM, rank, generator=gen) * 0.1
    for s in range(num_slots):  # the registry zeroes the padding past each rank
        a[s, int(ranks[s]) :] = 0.0
        b[s, :, int(ranks[s]) :] = 0.0
    x = torch.randn(batch, HIDDEN, generator=gen)
    out = {"x": x.to(dtype), "a": a.to(dtype), "b": b.to(dtype), "token_slots": token_slots, "ranks": ranks}
    return {k: v.to(DEVICE) for k, v in out.items()}


def _runs_case(
    rank: int, batch: int, dtype: torch.dtype, popularity: str, num_slices: int = 3, seed: int = 0
) -> dict:
    """A fused linear of ``num_slices`` slices in the GPU layout, rows sorted by slot. Slot ``s``
    skips slice ``i`` when ``(s + i) % 4 == 3`` (rank 0 there). The padding past each rank is zero,
    except in slot 0 where it is poisoned: a kernel reading past a rank would be caught."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank * 31 + batch + num_slices)
    token_slots, num_slots = _token_slots(popularity, batch, gen)
    token_slots = torch.sort(token_slots).values
    widths = WIDTHS[:num_slices]
    bounds = [sum(widths[:i]) for i in range(num_slices + 1)]
    ranks = torch.zeros(num_slots, num_slices, dtype=torch.int32)
    a = torch.randn(num_slots, num_slices * rank, HIDDEN, generator=gen) * 0.1
    b = torch.randn(num_slots, bounds[-1], rank, generator=gen) * 0.1
    for s in range(num_slots):
        for i in range(num_slices):
            r = 0 if num_slices > 1 and (s + i) % 4 == 3 else max(1, rank >> (s % 3))
            ranks[s, i] = r
            pad = 1e3 if s == 0 else 0.0
            a[s, i * rank + r : (i + 1) * rank] = pad
            b[s, bounds[i] : bounds[i + 1], r:] = pad
    ranges = _ranges(token_slots)
    out = {
        "x": torch.randn(batch, HIDDEN, generator=gen).to(dtype),
        "a": a.to(dtype),
        "b": b.to(dtype),
        "buf": torch.randn(batch, num_slices * rank, generator=gen),
        "y": torch.randn(batch, bounds[-1], generator=gen).to(dtype),
        "runs": slot_runs(ranges, num_slots),
        "ranks": ranks,
        "bounds": torch.tensor(bounds, dtype=torch.int32),
        "token_slots": token_slots,
    }
    out = {k: v.to(DEVICE) for k, v in out.items()}
    out["max_rows"] = max((e - s for _, s, e in ranges), default=0)
    out["max_width"] = max(widths)
    out["widths"] = widths
    return out


def _shrink(c: dict, **kw: object) -> torch.Tensor:
    out = torch.zeros(c["x"].shape[0], c["a"].shape[1], device=DEVICE)
    lora_shrink(c["x"], c["a"], out, c["runs"], c["ranks"], **{"max_rows": c["max_rows"], **kw})  # type: ignore[arg-type]
    return out


def _expand(c: dict, **kw: object) -> torch.Tensor:
    """The expand on ``c``'s buffers; ``compact=True``: on the compact grid."""
    y = c["y"].clone()
    kw = {
        "max_rows": c["max_rows"],
        "max_width": c["max_width"],
        "widths": c["widths"],
        "compact": False,
        **kw,
    }
    lora_expand(c["buf"], c["b"], y, c["runs"], c["ranks"], c["bounds"], **kw)  # type: ignore[arg-type]
    return y


def _ref_expand(c: dict) -> torch.Tensor:
    return ref_lora_expand_runs(c["y"], c["buf"], c["b"], c["runs"], c["ranks"], c["bounds"])


# ---------------------------------------------------------------------------------------------
# The Triton kernels (interpreted on CPU): every slice of a fused linear in one launch
# ---------------------------------------------------------------------------------------------


# Interpreted Triton is slow: cover every rank x batch once (popularity, dtype and slice count
# rotating), then every popularity x dtype at one mid-size shape, instead of the full product.
TRITON_CASES = [
    (rank, batch, DTYPES[(i + j) % 2], POPULARITY[(i + 2 * j) % 5], 1 + (i + j) % 3)
    for i, rank in enumerate(RANKS)
    for j, batch in enumerate(BATCHES)
] + [(33, 5, dtype, pop, 3) for dtype in DTYPES for pop in POPULARITY]
TRITON_IDS = [f"r{r}-b{b}-{str(d)[6:]}-{p}-p{n}" for r, b, d, p, n in TRITON_CASES]


@pytest.mark.parametrize(("rank", "batch", "dtype", "popularity", "num_slices"), TRITON_CASES, ids=TRITON_IDS)
def test_lora_shrink_expand(
    rank: int, batch: int, dtype: torch.dtype, popularity: str, num_slices: int
) -> None:
    c = _runs_case(rank, batch, dtype, popularity, num_slices)
    ref = ref_lora_shrink_runs(c["x"], c["a"], c["runs"], c["ranks"])
    torch.testing.assert_close(_shrink(c), ref, **_tol(dtype))
    torch.testing.assert_close(_expand(c), _ref_expand(c), **_tol(dtype))
    torch.testing.assert_close(_expand(c, compact=True), _ref_expand(c), **_tol(dtype))


def test_runs_reference_is_the_per_token_semantics() -> None:
    """The runs reference equals the per-token one applied slice by slice (rows of slot -1 and a
    slot's untargeted slices untouched)."""
    c = _runs_case(16, 16, torch.float32, "uniform")
    rank, num_slices = 16, 3
    buf = ref_lora_shrink_runs(c["x"], c["a"], c["runs"], c["ranks"])
    y = ref_lora_expand_runs(c["y"], buf, c["b"], c["runs"], c["ranks"], c["bounds"])
    want = c["y"].clone()
    for i in range(num_slices):
        lo, hi = int(c["bounds"][i]), int(c["bounds"][i + 1])
        a_i, b_i = c["a"][:, i * rank : (i + 1) * rank], c["b"][:, lo:hi]
        buf_i = ref_lora_shrink(c["x"], a_i, c["token_slots"], c["ranks"][:, i])
        torch.testing.assert_close(buf[:, i * rank : (i + 1) * rank], buf_i)
        want = ref_lora_expand(want, buf_i, b_i, c["token_slots"], c["ranks"][:, i], lo)
    torch.testing.assert_close(y, want)
    assert (y != c["y"]).any()


@pytest.mark.parametrize(
    ("rank", "batch", "dtype", "popularity"),
    [(16, 16, torch.float32, "zipf"), (33, 5, torch.float16, "uniform"), (8, 1, torch.float32, "identical")],
)
def test_expand_of_every_slots_shrink(rank: int, batch: int, dtype: torch.dtype, popularity: str) -> None:
    """``slot_cols``: ``buf`` holds every slot's shrink of every row (one dense GEMM over all
    slots' A, as a base GEMM with the A rows stacked under its weight would give); each row adds
    its own slot's columns only, the same delta as the per-slot shrink's output."""
    c = _runs_case(rank, batch, dtype, popularity)
    num_slots, p = c["ranks"].shape
    a = c["a"].clone()
    a[0] = 0.0  # the dense shrink reads the padding past each rank: zero, as the slots keep it
    for s in range(1, num_slots):
        for i in range(p):
            a[s, i * rank + int(c["ranks"][s, i]) : (i + 1) * rank] = 0.0
    c["a"] = a
    c["b"][0] = 0.0
    dense = (c["x"].float() @ a.reshape(num_slots * p * rank, -1).float().T).to(dtype)  # [T, S * P * R]
    want = ref_lora_expand_runs(c["y"], dense, c["b"], c["runs"], c["ranks"], c["bounds"], slot_cols=p * rank)
    for compact in (False, True):
        y = c["y"].clone()
        kw = {"max_rows": c["max_rows"], "max_width": c["max_width"], "slot_cols": p * rank,
              "widths": c["widths"], "compact": compact}  # fmt: skip
        lora_expand(dense, c["b"], y, c["runs"], c["ranks"], c["bounds"], **kw)  # type: ignore[arg-type]
        torch.testing.assert_close(y, want, **_tol(dtype))
    per_slot = ref_lora_expand_runs(
        c["y"],
        ref_lora_shrink_runs(c["x"], a, c["runs"], c["ranks"]),
        c["b"],
        c["runs"],
        c["ranks"],
        c["bounds"],
    )
    torch.testing.assert_close(want, per_slot, **_tol(dtype))
    assert (want != c["y"]).any()


@pytest.mark.parametrize("split_k", [2, 3])
def test_shrink_split_k_atomic(split_k: int) -> None:
    # Split-K accumulates partial sums with atomics into an fp32 output.
    c = _runs_case(33, 5, torch.float32, "uniform")
    ref = ref_lora_shrink_runs(c["x"], c["a"], c["runs"], c["ranks"])
    torch.testing.assert_close(_shrink(c, split_k=split_k), ref, **_tol(torch.float32))


def test_untouched_rows_and_columns() -> None:
    # Rows of no slot, columns past a slot's rank in a slice and untargeted slices keep whatever
    # the caller put there; the expand leaves rows of no slot as they were.
    c = _runs_case(16, 16, torch.float32, "uniform")
    sentinel = 7.0
    out = torch.full((16, 48), sentinel, device=DEVICE)
    lora_shrink(c["x"], c["a"], out, c["runs"], c["ranks"], max_rows=c["max_rows"], split_k=1)
    ref = ref_lora_shrink_runs(c["x"], c["a"], c["runs"], c["ranks"])
    written = torch.zeros(16, 48, dtype=torch.bool, device=DEVICE)
    for s in range(c["runs"].shape[1]):
        start, count = int(c["runs"][0, s]), int(c["runs"][1, s])
        for i in range(3):
            written[start : start + count, i * 16 : i * 16 + int(c["ranks"][s, i])] = True
    assert (~written).any() and written.any()
    torch.testing.assert_close(out, torch.where(written, ref, torch.full_like(ref, sentinel)))
    base_rows = c["token_slots"] < 0
    assert base_rows.any()
    for compact in (False, True):
        y = _expand(c, compact=compact)
        torch.testing.assert_close(y[base_rows], c["y"][base_rows])


def test_no_rows_with_an_adapter() -> None:
    c = _runs_case(8, 5, torch.float32, "uniform")
    c["runs"] = torch.zeros_like(c["runs"])
    torch.testing.assert_close(_expand(c, max_rows=5), c["y"])
    torch.testing.assert_close(_expand(c, max_rows=5, compact=True), c["y"])
    assert _shrink(c, max_rows=5).abs().sum() == 0


def test_fixed_grid_replays_any_mix() -> None:
    """The CUDA-graph form: one grid sized for the whole batch (``max_rows = T``) and the same
    ``runs`` tensor rewritten in place between launches for a different mix of adapters (an idle
    slot, a slot with every row) gives the same results as a grid fitted to each mix."""
    c = _runs_case(16, 16, torch.float32, "zipf", seed=2)
    runs = c["runs"]
    for mix in (
        c["token_slots"],
        torch.full((16,), 1, dtype=torch.int32),
        torch.tensor([-1] * 6 + [0] * 3 + [3] * 7),
    ):
        ranges = _ranges(mix)
        runs.copy_(slot_runs(ranges, runs.shape[1]))
        fitted = {**c, "max_rows": max(e - s for _, s, e in ranges)}
        ref = ref_lora_shrink_runs(c["x"], c["a"], runs, c["ranks"])
        torch.testing.assert_close(_shrink(c, max_rows=16), ref, **_tol(torch.float32))
        torch.testing.assert_close(_shrink(fitted), ref, **_tol(torch.float32))
        torch.testing.assert_close(_expand(c, max_rows=16), _ref_expand(c), **_tol(torch.float32))
        torch.testing.assert_close(
            _expand(c, max_rows=16, compact=True), _ref_expand(c), **_tol(torch.float32)
        )


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize(("block_m", "block_r", "block_n"), [(32, 32, 32), (16, 64, 16)])
def test_expand_tiles(block_m: int, block_r: int, block_n: int, compact: bool) -> None:
    # Larger row / rank tiles (GPU prefill tuning) must keep the rank masking exact; column tiles
    # narrower than a slice give the compact grid several per slice.
    c = _runs_case(33, 16, torch.float32, "skewed", seed=4)
    torch.testing.assert_close(
        _expand(c, block_m=block_m, block_r=block_r, block_n=block_n, compact=compact),
        _ref_expand(c),
        **_tol(torch.float32),
    )


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("popularity", ["identical", "skewed"])
def test_expand_runs_of_several_row_tiles(popularity: str, compact: bool) -> None:
    # A slot's run longer than a row tile: its tiles follow each other (in the compact grid,
    # after the other slots' tiles before it), each at its own row offset.
    c = _runs_case(16, 40, torch.float32, popularity, seed=5)
    assert c["max_rows"] > 16
    torch.testing.assert_close(_expand(c, compact=compact), _ref_expand(c), **_tol(torch.float32))
    torch.testing.assert_close(
        _expand(c, max_rows=40, compact=compact), _ref_expand(c), **_tol(torch.float32)
    )  # a graph's grid


def test_compact_row_tiles_bound_every_mix() -> None:
    """The compact grid's row tiles cover every slot's tiles for any runs of T rows (rows of no
    slot among them), and are fewer than the plain grid's slot x tile programs once slots share
    a batch: 19 instead of 64 for a 64-row CUDA graph over 16 slots."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(2000):
        t = int(torch.randint(1, 300, (), generator=gen))
        slots = int(torch.randint(1, 33, (), generator=gen))
        bm = int(torch.tensor([16, 32, 64])[torch.randint(0, 3, (), generator=gen)])
        cuts = torch.sort(torch.randint(0, t + 1, (slots + 1,), generator=gen)).values.tolist()
        counts = [b - a for a, b in zip(cuts, cuts[1:])]  # the rest: rows without an adapter
        need = sum(-(-n // bm) for n in counts)
        assert need <= compact_row_tiles(t, max(counts), slots, bm), (t, slots, bm, counts)
        assert compact_row_tiles(t, t, slots, bm) >= need  # a graph's grid: max_rows = T
    assert compact_row_tiles(64, 64, 16, 16) == 19 and compact_row_tiles(1, 1, 16, 16) == 1


# ---------------------------------------------------------------------------------------------
# CPU path: add_lora_cpu
# ---------------------------------------------------------------------------------------------


def _meta(token_slots: torch.Tensor, ranks: torch.Tensor) -> LoRAMetadata:
    ranges = _ranges(token_slots)
    return LoRAMetadata(
        ranges=ranges, max_rank=int(ranks.max()), max_rows=max((e - s for _, s, e in ranges), default=0)
    )


@pytest.mark.parametrize("form", ["view", "gather", "loop", "auto", "native"])
@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_lora_cpu(rank: int, batch: int, dtype: torch.dtype, popularity: str, form: str) -> None:
    """CPU path, batched over a view of the slot range or the gathered slots, as the per-adapter
    loop and split between them as the engine plans it: slots target different subsets of
    q/k/v-like slices with mixed ranks, rows in adapter order as the runner builds them (base rows
    first), some slots idle."""
    if DEVICE != "cpu":
        pytest.skip("the CPU path")
    if form == "native" and (dtype != torch.float32 or cpu_native.load() is None):
        pytest.skip("the C++ op: fp32, and only where it builds (tests/kernels/test_cpu_native.py)")
    c = _case(rank, batch, dtype, popularity, seed=5)
    gen = torch.Generator().manual_seed(11)
    widths = [32, 16, 24]
    offsets = [0, 32, 48]
    ranks = c["ranks"].tolist()
    num_slots = len(ranks)
    slot_slices = [[i for i in range(3) if (s + i) % 4 != 3] for s in range(num_slots)]
    a_slices: list[torch.Tensor | None] = [torch.zeros(num_slots, rank, HIDDEN, dtype=dtype) for _ in widths]
    b_slices: list[torch.Tensor | None] = [torch.zeros(num_slots, n, rank, dtype=dtype) for n in widths]
    for s in range(num_slots):
        r = ranks[s]
        for i in slot_slices[s]:
            a_slices[i][s, :r] = (torch.randn(r, HIDDEN, generator=gen) * 0.1).to(dtype)  # type: ignore[index]
            b_slices[i][s, :, :r] = (torch.randn(widths[i], r, generator=gen) * 0.1).to(dtype)  # type: ignore[index]
    token_slots, x = c["token_slots"], c["x"]
    order = torch.sort(token_slots, stable=True).indices  # the runner's order: by adapter slot
    token_slots, x = token_slots[order], x[order]
    meta = _meta(token_slots, c["ranks"])
    y0 = torch.randn(x.shape[0], sum(widths), generator=gen).to(dtype)
    y = y0.clone()
    if form == "loop":
        plan = CpuLoRAPlan(loop=meta.ranges)
    elif form == "native":  # rows of adapters past NATIVE_MAX_ROWS stay in the loop
        meta.native = True
        plan = None
    elif form == "auto":  # the engine's choice: the heaviest adapters looped when padding is high
        plan = None
    else:
        plan = build_cpu_lora_plan(meta, use_view=form == "view", batch_all=True)
    bt_slices = [b.transpose(1, 2).contiguous() for b in b_slices]  # type: ignore[union-attr]
    add_lora_cpu(y, x, a_slices, bt_slices, meta, offsets, ranks, plan=plan)

    ref = y0.clone().float()
    for a, b, off in zip(a_slices, b_slices, offsets):
        buf = ref_lora_shrink(x.float(), a.float(), token_slots, c["ranks"], 1.0)  # type: ignore[union-attr]
        ref = ref_lora_expand(ref, buf, b.float(), token_slots, c["ranks"], off)  # type: ignore[union-attr]
    torch.testing.assert_close(y, ref.to(dtype), **_tol(dtype))


def test_cpu_lora_plan_loops_the_prefill_and_batches_the_decodes() -> None:
    """A mixed step (base rows, three decoding adapters, one 40-token prefill chunk between them,
    an idle slot): the chunk runs in the loop, the decodes batched into non-contiguous rows."""
    gen = torch.Generator().manual_seed(3)
    counts = {-1: 2, 0: 1, 1: 2, 2: 40, 4: 1}  # slot -> rows (slot 3 idle)
    token_slots = torch.tensor([s for s, n in counts.items() for _ in range(n)], dtype=torch.int32)
    ranks = torch.tensor([8, 4, 16, 8, 2], dtype=torch.int32)
    meta = _meta(token_slots, ranks)
    plan = build_cpu_lora_plan(meta)
    assert plan.loop == [(2, 5, 45)] and len(plan.batches) == 1
    bt = plan.batches[0]
    assert bt.rows is not None and bt.rows.tolist() == [2, 3, 4, 45] and bt.length == 2 and bt.rank == 16
    # A linear slot 1 does not target (rank 0 there): only slots 0 and 4 batched, at their rank.
    own = cpu_lora_plan(meta, [8, 0, 16, 8, 2])
    assert own.loop == [(2, 5, 45)] and [b.rank for b in own.batches] == [8]
    assert own.batches[0].rows is not None and own.batches[0].rows.tolist() == [2, 45]
    assert cpu_lora_plan(meta, [8, 0, 16, 8, 2]) is own  # cached for the step's other such linears
    x = torch.randn(token_slots.numel(), HIDDEN, generator=gen)
    a = torch.randn(5, 16, HIDDEN, generator=gen) * 0.1
    b = torch.randn(5, OUT_DIM, 16, generator=gen) * 0.1
    for slot, r in enumerate(ranks.tolist()):
        a[slot, r:] = 0
        b[slot, :, r:] = 0
    y0 = torch.randn(x.shape[0], OUT_DIM, generator=gen)
    y = y0.clone()
    add_lora_cpu(y, x, [a], [b.transpose(1, 2).contiguous()], meta, [0], ranks.tolist())
    ref = ref_lora_expand(y0, ref_lora_shrink(x, a, token_slots, ranks, 1.0), b, token_slots, ranks, 0)
    torch.testing.assert_close(y, ref, **_tol(torch.float32))
    # The C++ op takes every light adapter as a (slot, start, end) segment, no grid; the chunk loops.
    meta.native, meta.derived = True, {}
    native = cpu_lora_plan(meta, [8, 0, 16, 8, 2])
    assert native.loop == [(2, 5, 45)] and not native.batches and native.native_segs == [0, 2, 3, 4, 45, 46]
    if cpu_native.load() is not None:
        y = y0.clone()
        add_lora_cpu(y, x, [a], [b.transpose(1, 2).contiguous()], meta, [0], ranks.tolist())
        torch.testing.assert_close(y, ref, **_tol(torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 64, 512])
def test_lora_gpu_realistic(dtype: torch.dtype, batch: int) -> None:
    """Real compilation at serving sizes: q/k/v of a 4096-wide GQA model (4096 / 1024 / 1024
    columns), rank 64 with mixed ranks and skipped slices, 8 slots, bf16 too, against the fp32
    reference computed by torch matmuls per slot and slice."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden, rank, slots = 4096, 64, 8
    widths = [4096, 1024, 1024]
    bounds = [0, 4096, 5120, 6144]
    ranks = torch.tensor([64, 16, 8, 64, 32, 1, 16, 64], dtype=torch.int32).repeat_interleave(3).view(8, 3)
    ranks[1, 1] = ranks[5, 0] = 0
    x = torch.randn(batch, hidden, generator=gen, device="cuda").to(dtype)
    a = (torch.randn(slots, 3 * rank, hidden, generator=gen, device="cuda") * 0.02).to(dtype)
    b = (torch.randn(slots, bounds[-1], rank, generator=gen, device="cuda") * 0.02).to(dtype)
    token_slots = torch.sort(torch.randint(-1, slots, (batch,), generator=gen, device="cuda")).values.to(
        torch.int32
    )
    ranges = _ranges(token_slots)
    runs = slot_runs(ranges, slots, "cuda")
    y0 = torch.randn(batch, bounds[-1], generator=gen, device="cuda").to(dtype)
    ref_buf = torch.zeros(batch, 3 * rank, device="cuda")
    ref_y = y0.float().clone()
    for s, start, end in ranges:
        for i in range(3):
            r = int(ranks[s, i])
            cols = slice(i * rank, i * rank + r)
            ref_buf[start:end, cols] = x[start:end].float() @ a[s, cols].float().t()
            ref_y[start:end, bounds[i] : bounds[i + 1]] += (
                ref_buf[start:end, cols] @ b[s, bounds[i] : bounds[i + 1], :r].float().t()
            )
    max_rows = max((e - s for _, s, e in ranges), default=0)
    # fitted grid (eager) and the whole batch (a CUDA graph), each on the plain and compact grids
    for rows, compact in [(max_rows, False), (batch, False), (max_rows, True), (batch, True)]:
        buf = torch.zeros(batch, 3 * rank, device="cuda")
        y = y0.clone()
        lora_shrink(x, a, buf, runs, ranks.cuda(), max_rows=rows)
        lora_expand(buf, b, y, runs, ranks.cuda(), torch.tensor(bounds, dtype=torch.int32, device="cuda"),
                    max_rows=rows, max_width=max(widths), widths=widths, compact=compact)  # fmt: skip
        torch.testing.assert_close(buf, ref_buf, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(y.float(), ref_y, atol=3e-2, rtol=3e-2)
