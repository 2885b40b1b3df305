"""Punica-style multi-LoRA ops vs the plain reference: Triton (interpreter on CPU) and torch paths.

Mixed ranks in one batch throughout: slot ``s`` has rank ``max(1, R >> (s % 3))`` (R, R/2, R/4).
"""

from __future__ import annotations

import pytest
import torch

from lorastar.forward_context import LoRAMetadata
from lorastar.kernels import cpu_native
from lorastar.kernels.lora import (
    bgmv_expand,
    bgmv_shrink,
    groups_from_segments,
    groups_from_slots,
    lora_expand_torch,
    lora_shrink_torch,
    sgmv_expand,
    sgmv_shrink,
)
from lorastar.kernels.reference import ref_lora_expand, ref_lora_shrink
from lorastar.layers.lora import CpuLoRAPlan, add_lora, add_lora_cpu, build_cpu_lora_plan, cpu_lora_plan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN = 64  # small: every interpreted Triton program costs ~0.2 ms
OUT_DIM = 48  # not a multiple of the N tile: exercises the masked edge
NUM_SLOTS = 4
RANKS = [1, 8, 16, 33, 64]
BATCHES = [1, 5, 16]
DTYPES = [torch.float32, torch.float16]
POPULARITY = ["distinct", "uniform", "zipf", "identical", "skewed"]


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


def _segments(token_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of consecutive equal slots, as the runner builds them."""
    starts, slots = [0], []
    vals = token_slots.tolist()
    for i, s in enumerate(vals):
        if i > 0 and s != vals[i - 1]:
            starts.append(i)
            slots.append(vals[i - 1])
    if vals:
        starts.append(len(vals))
        slots.append(vals[-1])
    return torch.tensor(starts, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32)


def _case(
    rank: int, batch: int, dtype: torch.dtype, popularity: str, seed: int = 0
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1000 + rank * 31 + batch)
    token_slots, num_slots = _token_slots(popularity, batch, gen)
    seg_starts, seg_slots = _segments(token_slots)
    ranks = _slot_ranks(rank, num_slots)
    a = torch.randn(num_slots, rank, HIDDEN, generator=gen) * 0.1
    b = torch.randn(num_slots, OUT_DIM, rank, generator=gen) * 0.1
    # Zero the padding past each slot's rank like the registry does, except poison it in slot 0:
    # a kernel that reads past the rank would then be caught.
    for s in range(num_slots):
        a[s, int(ranks[s]) :] = 0.0
        b[s, :, int(ranks[s]) :] = 0.0
    a[0, int(ranks[0]) :] = 1e3
    b[0, :, int(ranks[0]) :] = 1e3
    x = torch.randn(batch, HIDDEN, generator=gen)
    buf = torch.randn(batch, rank, generator=gen)
    y = torch.randn(batch, OUT_DIM + 16, generator=gen)
    out = {
        "x": x.to(dtype),
        "a": a.to(dtype),
        "b": b.to(dtype),
        "buf": buf.to(dtype),
        "y": y.to(dtype),
        "token_slots": token_slots,
        "seg_starts": seg_starts,
        "seg_slots": seg_slots,
        "ranks": ranks,
    }
    return {k: v.to(DEVICE) for k, v in out.items()}


def _ref_shrink(c: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    return ref_lora_shrink(c["x"], c["a"], c["token_slots"], c["ranks"], scale)


# ---------------------------------------------------------------------------------------------
# Single ops, Triton path (interpreted on CPU)
# ---------------------------------------------------------------------------------------------


# Interpreted Triton is slow: cover every rank x batch once (popularity and dtype rotating), then
# every popularity x dtype at one mid-size shape, instead of the full cartesian product.
TRITON_CASES = [
    (rank, batch, DTYPES[(i + j) % 2], POPULARITY[(i + 2 * j) % 5])
    for i, rank in enumerate(RANKS)
    for j, batch in enumerate(BATCHES)
] + [(33, 5, dtype, pop) for dtype in DTYPES for pop in POPULARITY]
TRITON_IDS = [f"r{r}-b{b}-{str(d)[6:]}-{p}" for r, b, d, p in TRITON_CASES]


@pytest.mark.parametrize(("rank", "batch", "dtype", "popularity"), TRITON_CASES, ids=TRITON_IDS)
def test_bgmv_triton(rank: int, batch: int, dtype: torch.dtype, popularity: str) -> None:
    c = _case(rank, batch, dtype, popularity)
    out = torch.zeros(batch, rank, dtype=dtype, device=DEVICE)
    bgmv_shrink(c["x"], c["a"], out, c["token_slots"], c["ranks"], 0.5, force_triton=True)
    torch.testing.assert_close(out, _ref_shrink(c, 0.5), **_tol(dtype))

    y = c["y"].clone()
    bgmv_expand(c["buf"], c["b"], y, c["token_slots"], c["ranks"], 8, force_triton=True)
    ref = ref_lora_expand(c["y"], c["buf"], c["b"], c["token_slots"], c["ranks"], 8)
    torch.testing.assert_close(y, ref, **_tol(dtype))


@pytest.mark.parametrize(("rank", "batch", "dtype", "popularity"), TRITON_CASES, ids=TRITON_IDS)
def test_sgmv_triton(rank: int, batch: int, dtype: torch.dtype, popularity: str) -> None:
    c = _case(rank, batch, dtype, popularity, seed=1)
    out = torch.zeros(batch, rank, dtype=dtype, device=DEVICE)
    sgmv_shrink(c["x"], c["a"], out, c["seg_starts"], c["seg_slots"], c["ranks"], 2.0, force_triton=True)
    torch.testing.assert_close(out, _ref_shrink(c, 2.0), **_tol(dtype))

    y = c["y"].clone()
    sgmv_expand(c["buf"], c["b"], y, c["seg_starts"], c["seg_slots"], c["ranks"], 16, force_triton=True)
    ref = ref_lora_expand(c["y"], c["buf"], c["b"], c["token_slots"], c["ranks"], 16)
    torch.testing.assert_close(y, ref, **_tol(dtype))


@pytest.mark.parametrize("split_k", [2, 3])
def test_shrink_split_k_atomic(split_k: int) -> None:
    # Split-K accumulates partial sums with atomics into an fp32 output.
    c = _case(33, 5, torch.float32, "uniform")
    for op in ("bgmv", "sgmv"):
        out = torch.zeros(5, 33, device=DEVICE)
        if op == "bgmv":
            bgmv_shrink(c["x"], c["a"], out, c["token_slots"], c["ranks"], force_triton=True, split_k=split_k)
        else:
            sgmv_shrink(
                c["x"],
                c["a"],
                out,
                c["seg_starts"],
                c["seg_slots"],
                c["ranks"],
                force_triton=True,
                split_k=split_k,
            )
        torch.testing.assert_close(out, _ref_shrink(c, 1.0), **_tol(torch.float32))


@pytest.mark.parametrize("use_triton", [True, False])
def test_untouched_rows_and_columns(use_triton: bool) -> None:
    # -1 rows and columns past a slot's rank keep whatever the caller put there.
    c = _case(16, 16, torch.float32, "uniform")
    sentinel = 7.0
    out = torch.full((16, 16), sentinel, device=DEVICE)
    sgmv_out = out.clone()
    bgmv_shrink(c["x"], c["a"], out, c["token_slots"], c["ranks"], force_triton=use_triton, split_k=1)
    sgmv_shrink(
        c["x"],
        c["a"],
        sgmv_out,
        c["seg_starts"],
        c["seg_slots"],
        c["ranks"],
        force_triton=use_triton,
        split_k=1,
    )
    ref = _ref_shrink(c, 1.0)
    slots = c["token_slots"].long()
    written = torch.zeros(16, 16, dtype=torch.bool, device=DEVICE)
    for t in range(16):
        if slots[t] >= 0:
            written[t, : int(c["ranks"][slots[t]])] = True
    expected = torch.where(written, ref, torch.full_like(ref, sentinel))
    torch.testing.assert_close(out, expected, **_tol(torch.float32))
    torch.testing.assert_close(sgmv_out, expected, **_tol(torch.float32))


def test_all_rows_without_adapter() -> None:
    c = _case(8, 5, torch.float32, "uniform")
    none = torch.full((5,), -1, dtype=torch.int32, device=DEVICE)
    y = c["y"].clone()
    bgmv_expand(c["buf"], c["b"], y, none, c["ranks"], 0, force_triton=True)
    sgmv_expand(
        c["buf"], c["b"], y, torch.tensor([0, 5], dtype=torch.int32, device=DEVICE), none[:1], c["ranks"], 0,
        force_triton=True,
    )  # fmt: skip
    torch.testing.assert_close(y, c["y"])


# ---------------------------------------------------------------------------------------------
# Torch path (CPU hot path): grouped matmuls
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_path(rank: int, batch: int, dtype: torch.dtype, popularity: str) -> None:
    c = _case(rank, batch, dtype, popularity, seed=2)
    for groups in (
        groups_from_slots(c["token_slots"]),
        groups_from_segments(c["seg_starts"], c["seg_slots"]),
    ):
        out = torch.zeros(batch, rank, dtype=dtype, device=DEVICE)
        lora_shrink_torch(c["x"], c["a"], out, groups, c["ranks"], 0.5)
        torch.testing.assert_close(out, _ref_shrink(c, 0.5), **_tol(dtype))
        y = c["y"].clone()
        lora_expand_torch(c["buf"], c["b"], y, groups, c["ranks"], 4)
        ref = ref_lora_expand(c["y"], c["buf"], c["b"], c["token_slots"], c["ranks"], 4)
        torch.testing.assert_close(y, ref, **_tol(dtype))


# ---------------------------------------------------------------------------------------------
# add_lora: the fused-linear entry point, several slices at column offsets
# ---------------------------------------------------------------------------------------------


def _meta(c: dict[str, torch.Tensor], is_decode: bool) -> LoRAMetadata:
    meta = LoRAMetadata(
        token_slots=c["token_slots"],
        seg_starts=c["seg_starts"],
        seg_slots=c["seg_slots"],
        ranks=c["ranks"],
        max_rank=int(c["ranks"].max()),
        is_decode=is_decode,
    )
    groups = groups_from_slots(c["token_slots"])
    if all(int(r[-1]) - int(r[0]) + 1 == r.numel() for _, r in groups):  # rows in adapter order
        meta.ranges = [(slot, int(r[0]), int(r[-1]) + 1) for slot, r in groups]
    return meta


@pytest.mark.parametrize("num_slices", [1, 2, 3])
@pytest.mark.parametrize("is_decode", [True, False])
@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("popularity", POPULARITY)
def test_add_lora(num_slices: int, is_decode: bool, path: str, dtype: torch.dtype, popularity: str) -> None:
    use_triton = path == "triton"
    if not use_triton and DEVICE != "cpu":
        pytest.skip("the torch path is the CPU path")
    if use_triton and popularity != "zipf":
        pytest.skip("interpreted Triton: one popularity here, all of them in test_bgmv/sgmv_triton")
    rank, batch = 16, 9
    c = _case(rank, batch, dtype, popularity, seed=3)
    gen = torch.Generator().manual_seed(7)
    widths = [32, 16, 24][:num_slices]
    offsets = [sum(widths[:i]) for i in range(num_slices)]
    num_slots = c["a"].shape[0]
    a_slices: list[torch.Tensor | None] = []
    b_slices: list[torch.Tensor | None] = []
    for i, n in enumerate(widths):
        if num_slices == 3 and i == 1:  # adapter set targets no module of this slice
            a_slices.append(None)
            b_slices.append(None)
            continue
        a = (torch.randn(num_slots, rank, HIDDEN, generator=gen) * 0.1).to(dtype).to(DEVICE)
        b = (torch.randn(num_slots, n, rank, generator=gen) * 0.1).to(dtype).to(DEVICE)
        for s in range(num_slots):  # the registry zeroes the padding past each rank
            a[s, int(c["ranks"][s]) :] = 0
            b[s, :, int(c["ranks"][s]) :] = 0
        a_slices.append(a)
        b_slices.append(b)
    y0 = torch.randn(batch, sum(widths), generator=gen).to(dtype).to(DEVICE)
    y = y0.clone()
    x = c["x"]
    meta = _meta(c, is_decode)
    add_lora(y, x, a_slices, b_slices, meta, offsets, force_triton=use_triton)

    ref = y0.clone()
    for a, b, off in zip(a_slices, b_slices, offsets):
        if a is None or b is None:
            continue
        buf = ref_lora_shrink(x.float(), a.float(), c["token_slots"], c["ranks"], 1.0)
        ref = ref_lora_expand(ref.float(), buf, b.float(), c["token_slots"], c["ranks"], off).to(dtype)
    torch.testing.assert_close(y, ref, **_tol(dtype))


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
    meta = _meta({**c, "token_slots": token_slots, "x": x}, is_decode=True)
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
    seg_starts, seg_slots = _segments(token_slots)
    meta = _meta(
        {"token_slots": token_slots, "seg_starts": seg_starts, "seg_slots": seg_slots, "ranks": ranks},
        is_decode=False,
    )
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
    """Real compilation at serving sizes (hidden 4096, rank 64 with mixed ranks, bf16 too)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden, n, rank, slots = 4096, 4096, 64, 8
    ranks = torch.tensor([64, 16, 8, 64, 32, 1, 16, 64], dtype=torch.int32, device="cuda")
    x = torch.randn(batch, hidden, generator=gen, device="cuda").to(dtype)
    a = (torch.randn(slots, rank, hidden, generator=gen, device="cuda") * 0.02).to(dtype)
    b = (torch.randn(slots, n, rank, generator=gen, device="cuda") * 0.02).to(dtype)
    for s in range(slots):
        a[s, int(ranks[s]) :] = 0
        b[s, :, int(ranks[s]) :] = 0
    token_slots = torch.randint(-1, slots, (batch,), generator=gen, device="cuda").to(torch.int32)
    token_slots, _ = torch.sort(token_slots)
    seg_starts, seg_slots = _segments(token_slots.cpu())
    seg_starts, seg_slots = seg_starts.cuda(), seg_slots.cuda()
    y0 = torch.randn(batch, n, generator=gen, device="cuda").to(dtype)
    ref_buf = torch.zeros(batch, rank, device="cuda")
    lora_shrink_torch(x.float(), a.float(), ref_buf, groups_from_slots(token_slots), ranks)
    ref_y = y0.float().clone()
    lora_expand_torch(ref_buf, b.float(), ref_y, groups_from_slots(token_slots), ranks, 0)
    for form in ("bgmv", "sgmv"):
        buf = torch.zeros(batch, rank, device="cuda")
        y = y0.clone()
        if form == "bgmv":
            bgmv_shrink(x, a, buf, token_slots, ranks)
            bgmv_expand(buf, b, y, token_slots, ranks, 0)
        else:
            sgmv_shrink(x, a, buf, seg_starts, seg_slots, ranks)
            sgmv_expand(buf, b, y, seg_starts, seg_slots, ranks, 0)
        torch.testing.assert_close(buf, ref_buf, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(y.float(), ref_y, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(("block_m", "block_r"), [(32, 32), (16, 64)])
def test_sgmv_expand_tiles(block_m: int, block_r: int) -> None:
    # Larger row / rank tiles (GPU prefill tuning) must keep the rank masking exact.
    c = _case(33, 16, torch.float32, "skewed", seed=4)
    y = c["y"].clone()
    sgmv_expand(
        c["buf"], c["b"], y, c["seg_starts"], c["seg_slots"], c["ranks"], 8,
        force_triton=True, block_m=block_m, block_r=block_r,
    )  # fmt: skip
    ref = ref_lora_expand(c["y"], c["buf"], c["b"], c["token_slots"], c["ranks"], 8)
    torch.testing.assert_close(y, ref, **_tol(torch.float32))
