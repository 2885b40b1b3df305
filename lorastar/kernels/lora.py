"""Punica-style batched multi-LoRA over a fused linear: shrink (``x @ A.T``) and expand
(``y += buf @ B.T``), one launch each for all of the linear's slices (q/k/v, gate/up).

Many adapters serve one flat token batch whose rows are ordered by adapter slot, so each slot's
rows are one contiguous run: ``slot_runs [2, S]`` holds each slot's (start, count), count 0 for a
slot absent from the step (vLLM's ``LoRAKernelMeta`` shape: fixed size, so a CUDA graph captured
with it replays for any mix of adapters). The grid is ``(slot, tile of rows, slice x tile)``;
programs past a slot's count, of a slot's untargeted slice (rank 0) or past a slice's width exit
at once. The expand has a compact grid too (``EXPAND_COMPACT_GRID``): only the row tiles that
can hold rows and the column tiles that hold columns.

Weights of a linear's ``P`` slices sit in one buffer each: ``lora_a [S, P * R, H]`` (slice ``i``'s
A in rows ``i * R .. i * R + R``) and ``lora_b [S, Ntot, R]`` (slice ``i``'s B in the rows of its
output columns ``bounds[i] .. bounds[i + 1]``, scaling folded in), padded to the largest rank
``R``; ``ranks [S, P]`` is each slot's true rank per slice and the kernels loop over rank chunks
only up to it, so a rank-8 adapter batched with a rank-64 one costs rank-8 work.

Triton only: on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (the tests). The engine's
CPU path is ``layers/lora.py``'s ``add_lora_cpu``; the plain semantics are in ``reference.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lorastar.kernels._triton import HAS_TRITON, num_sms, tl, triton

if HAS_TRITON:

    @triton.jit
    def _lora_shrink_kernel(
        x_ptr, a_ptr, out_ptr, runs_ptr, ranks_ptr,
        H, R, P, SPLIT, K_PER_SPLIT,
        stride_runs,
        stride_xt, stride_xh,
        stride_as, stride_ar, stride_ah,
        stride_ot, stride_or,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
        ATOMIC: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        # One program per (slot, tile of BLOCK_M rows, slice x split of H).
        s = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_ik = tl.program_id(2)
        count = tl.load(runs_ptr + stride_runs + s)
        m_start = pid_m * BLOCK_M
        if m_start >= count:
            return
        i = pid_ik // SPLIT
        pid_k = pid_ik % SPLIT
        rank = tl.load(ranks_ptr + s * P + i)
        if rank <= 0:
            return
        start = tl.load(runs_ptr + s)
        offs = m_start + tl.arange(0, BLOCK_M)
        m_mask = offs < count
        offs_m = (start + offs).to(tl.int64)
        k_start = pid_k * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, H)
        offs_r = tl.arange(0, BLOCK_R)
        offs_k = tl.arange(0, BLOCK_K)
        col0 = i * R
        a_base = a_ptr + s.to(tl.int64) * stride_as + col0.to(tl.int64) * stride_ar
        # Loop only over this slot's rank in this slice: smaller adapters in a mixed batch cost less.
        for r0 in range(0, rank, BLOCK_R):
            rr = r0 + offs_r
            r_mask = rr < rank
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k0 in range(k_start, k_end, BLOCK_K):
                kk = k0 + offs_k
                k_mask = kk < k_end
                xv = tl.load(
                    x_ptr + offs_m[:, None] * stride_xt + kk[None, :] * stride_xh,
                    mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0,
                )  # [BM, BK]
                av = tl.load(
                    a_base + kk[:, None] * stride_ah + rr[None, :] * stride_ar,
                    mask=k_mask[:, None] & r_mask[None, :],
                    other=0.0,
                )  # [BK, BR] (A^T tile)
                if IEEE:
                    acc += tl.dot(xv.to(tl.float32), av.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(xv, av.to(xv.dtype))
            o_ptrs = out_ptr + offs_m[:, None] * stride_ot + (col0 + rr)[None, :] * stride_or
            o_mask = m_mask[:, None] & r_mask[None, :]
            if ATOMIC:
                tl.atomic_add(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
            else:
                tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)

    @triton.jit
    def _lora_expand_kernel(
        buf_ptr, b_ptr, y_ptr, runs_ptr, ranks_ptr, bounds_ptr,
        R, P, N_TILES, SLOT_COLS, S,
        stride_runs,
        stride_bt, stride_br,
        stride_bs, stride_bn, stride_bk,
        stride_yt, stride_yn,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
        COMPACT: tl.constexpr, S_P2: tl.constexpr, P_P2: tl.constexpr,
    ):  # fmt: skip
        # Each y element has one owner, so no atomics. Plain grid: one program per (slot, tile of
        # rows, slice x tile of its columns). COMPACT grid: (row tile, column tile), the row
        # tiles of every slot's run back to back (slot s's after those of slots < s) and the
        # column tiles of every slice back to back, each program finding its own from the
        # counts and bounds; only the tiles past the step's last one exit.
        if COMPACT:
            offs_s = tl.arange(0, S_P2)
            counts = tl.load(runs_ptr + stride_runs + offs_s, mask=offs_s < S, other=0)  # [S_P2]
            tiles = (counts + BLOCK_M - 1) // BLOCK_M
            pid = tl.program_id(0)
            s = tl.sum((tl.cumsum(tiles, 0) <= pid).to(tl.int32))  # the slot whose tiles hold pid
            if s >= S:
                return
            count = tl.sum(tl.where(offs_s == s, counts, 0))
            m_start = (pid - tl.sum(tl.where(offs_s < s, tiles, 0))) * BLOCK_M
            offs_p = tl.arange(0, P_P2)
            lo = tl.load(bounds_ptr + offs_p, mask=offs_p < P, other=0)  # [P_P2]
            hi = tl.load(bounds_ptr + offs_p + 1, mask=offs_p < P, other=0)
            col_tiles = (hi - lo + BLOCK_N - 1) // BLOCK_N
            pid_c = tl.program_id(1)
            i = tl.sum((tl.cumsum(col_tiles, 0) <= pid_c).to(tl.int32))
            if i >= P:
                return
            pid_n = pid_c - tl.sum(tl.where(offs_p < i, col_tiles, 0))
        else:
            s = tl.program_id(0)
            pid_m = tl.program_id(1)
            pid_in = tl.program_id(2)
            count = tl.load(runs_ptr + stride_runs + s)
            m_start = pid_m * BLOCK_M
            if m_start >= count:
                return
            i = pid_in // N_TILES
            pid_n = pid_in % N_TILES
        rank = tl.load(ranks_ptr + s * P + i)
        if rank <= 0:
            return
        n_lo = tl.load(bounds_ptr + i) + pid_n * BLOCK_N
        n_hi = tl.load(bounds_ptr + i + 1)
        if n_lo >= n_hi:
            return
        start = tl.load(runs_ptr + s)
        offs = m_start + tl.arange(0, BLOCK_M)
        m_mask = offs < count
        offs_m = (start + offs).to(tl.int64)
        offs_n = n_lo + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_hi
        offs_r = tl.arange(0, BLOCK_R)
        col0 = s * SLOT_COLS + i * R
        b_base = b_ptr + s.to(tl.int64) * stride_bs
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            rr = r0 + offs_r
            r_mask = rr < rank
            bv = tl.load(
                buf_ptr + offs_m[:, None] * stride_bt + (col0 + rr)[None, :] * stride_br,
                mask=m_mask[:, None] & r_mask[None, :],
                other=0.0,
            )  # [BM, BR]
            wv = tl.load(
                b_base + rr[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                mask=r_mask[:, None] & n_mask[None, :],
                other=0.0,
            )  # [BR, BN] (B^T tile)
            if IEEE:
                acc += tl.dot(bv.to(tl.float32), wv.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(bv.to(wv.dtype), wv)
        y_ptrs = y_ptr + offs_m[:, None] * stride_yt + offs_n[None, :] * stride_yn
        y_mask = m_mask[:, None] & n_mask[None, :]
        yv = tl.load(y_ptrs, mask=y_mask, other=0.0)
        tl.store(y_ptrs, (yv.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


_BLOCK_R = 16  # rank chunk; tl.dot needs >= 16 on NVIDIA, the tail of the last chunk is masked

# The expand's compact grid: (row tiles of all slots back to back, column tiles of all slices
# back to back) instead of (slot, row tile, slice x column tile). The plain grid is sized for the
# worst case of each axis: a CUDA graph of 64 rows over 16 slots launches 16 x 4 row tiles of which
# at most 19 hold rows, and a q/k/v linear 3 x 16 column tiles of which 20 hold columns (k and v
# are narrow): 3072 programs for at most 380 with work, and the expand of a decode step is that
# small. On: H200, random 1.1B Llama in bf16, 16 rank-16 adapters on q/k/v/o, 64 requests, the
# expand took 198 vs 224 us of kernel time per decode step (gpu_step_profile.py --compact), and
# end to end 25217 vs 24244 tok/s (gpu_throughput.py --compact, one request 494 vs 486). The
# interpreter tests check that both grids give the same sums.
EXPAND_COMPACT_GRID = True


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("the LoRA kernels need Triton (pip install triton)")


def _split_k(programs: int, h: int, block_k: int, device: torch.device) -> int:
    """How many slices of H to give each row program so the GPU has enough programs in flight."""
    if device.type != "cuda":
        return 1
    want = max(1, (4 * num_sms(device)) // max(programs, 1))
    return max(1, min(want, triton.cdiv(h, block_k), 32))


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    out: torch.Tensor,
    slot_runs: torch.Tensor,
    ranks: torch.Tensor,
    *,
    max_rows: int,
    active_slots: int | None = None,
    split_k: int | None = None,
    block_k: int | None = None,
) -> None:
    """Segmented LoRA shrink of every slice of a fused linear in one launch.

    Semantics: ``for s, i: rows = runs[0, s] : runs[0, s] + runs[1, s]; r = ranks[s, i]; out[rows, i*R : i*R + r] = x[rows] @ lora_a[s, i*R : i*R + r].T``

    Args:
        x: ``[T, H]`` activations, rows ordered by slot.
        lora_a: ``[S, P * R, H]`` A of ``P`` slices per slot.
        out: ``[T, P * R]``, need not be initialized: each slot's rows get their slices' first
            ``rank`` columns; rows of no slot and columns past a slot's rank in a slice are left
            as they are (the expand reads neither). Zeroed here when ``H`` is split (atomics).
        slot_runs: ``[2, S]`` int32, (start, count) of each slot's rows.
        ranks: ``[S, P]`` int32 true rank per slot and slice (0: skipped).
        max_rows: the longest run, or any bound of it (a CUDA graph: its padded batch).
        active_slots: slots with rows (host hint for the split of H); ``None``: all ``S``.
        split_k: slices of ``H`` per row tile (atomics: needs an fp32 ``out``); ``None`` picks.
        block_k: ``H`` columns per loop step; ``None`` picks.
    """
    _require_triton()
    t, h = x.shape
    if t == 0 or max_rows == 0:
        return
    num_slots, p = ranks.shape
    rank = lora_a.shape[1] // p
    # 128-wide K steps: on the H200, 88 graph-captured linears of a 1.1B Llama (16 adapters,
    # rank 16, 64 rows) took 1.30 ms per step vs 1.46 ms with 64 (benchmarks/lora_graph_step.py).
    block_m, block_k = 16, block_k or (128 if x.is_cuda else 32)
    m_tiles = triton.cdiv(max_rows, block_m)
    if out.dtype != torch.float32:  # atomics in fp16 lose too much on large H
        split = 1
    elif split_k is not None:
        split = split_k
    else:
        split = _split_k((active_slots or num_slots) * m_tiles * p, h, block_k, x.device)
    kps = triton.cdiv(triton.cdiv(h, split), block_k) * block_k  # whole BLOCK_K tiles per split
    split = triton.cdiv(h, kps)
    if split > 1:
        out.zero_()
    _lora_shrink_kernel[(num_slots, m_tiles, p * split)](
        x, lora_a, out, slot_runs, ranks,
        h, rank, p, split, kps,
        slot_runs.stride(0),
        x.stride(0), x.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_R=_BLOCK_R, BLOCK_K=block_k,
        ATOMIC=split > 1, IEEE=x.dtype == torch.float32,
    )  # fmt: skip


def compact_row_tiles(t: int, max_rows: int, num_slots: int, block_m: int) -> int:
    """Row tiles of the compact grid: a bound of ``sum(cdiv(count_s, block_m))`` over the slots
    for any runs of ``t`` rows, none longer than ``max_rows``: with ``k`` slots holding rows,
    ``sum(floor((count_s - 1) / BM) + 1) <= floor((t - k) / BM) + k <= cdiv(t, BM) - 1 + k``."""
    return min(num_slots * -(-max_rows // block_m), -(-t // block_m) - 1 + min(num_slots, t))


def lora_expand(
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    y: torch.Tensor,
    slot_runs: torch.Tensor,
    ranks: torch.Tensor,
    bounds: torch.Tensor,
    *,
    max_rows: int,
    max_width: int,
    block_m: int | None = None,
    block_r: int | None = None,
    block_n: int | None = None,
    slot_cols: int = 0,
    widths: Sequence[int] | None = None,
    compact: bool | None = None,
) -> None:
    """Segmented LoRA expand of every slice of a fused linear in one launch, added into ``y``.

    Semantics: ``for s, i: rows = runs[0, s] : runs[0, s] + runs[1, s]; r = ranks[s, i]; c = s*slot_cols + i*R; y[rows, bounds[i] : bounds[i+1]] += buf[rows, c : c + r] @ lora_b[s, bounds[i] : bounds[i+1], :r].T``

    Args:
        buf: ``[T, P * R]`` shrink output; with ``slot_cols = P * R``, ``[T, S * P * R]``: every
            slot's shrink of every row (one dense ``x @ lora_a.view(S * P * R, H).T``), each row
            reading its own slot's columns.
        lora_b: ``[S, Ntot, R]`` B of every slice, rows at their output columns (scaled).
        y: ``[T, Ntot]`` base output, updated in place.
        slot_runs: ``[2, S]`` int32; ranks: ``[S, P]`` int32 (0: the slice is skipped).
        bounds: ``[P + 1]`` int32 first output column of each slice, then ``Ntot``.
        max_rows: the longest run, or a bound of it; max_width: the widest slice.
        slot_cols: columns of ``buf`` per slot (0: one ``[T, P * R]`` shrink output for all slots).
        widths: each slice's width (``bounds``' differences, known on the host): needed for the
            compact grid, which has one column tile per ``BLOCK_N`` of each slice.
        compact: the compact grid (``EXPAND_COMPACT_GRID``'s docstring); ``None``: that setting,
            where ``widths`` is given.
    """
    _require_triton()
    t = buf.shape[0]
    if t == 0 or max_rows == 0:
        return
    num_slots, p = ranks.shape
    rank = lora_b.shape[2]
    # Prefill-sized runs: 64-row x 32-rank tiles re-read B less often (H100 sweep, 2048 tokens,
    # rank 64: 34 us vs 104 us with 16 x 16). Small batches keep 16-row tiles (more programs).
    big = buf.is_cuda and max_rows >= 256
    block_m = block_m or (64 if big else 16)
    block_r = block_r or (32 if big else _BLOCK_R)
    # Decode-sized runs: 128-column tiles halve the programs (lora_graph_step.py: 1.26 vs 1.30 ms).
    block_n = block_n or ((64 if big else 128) if buf.is_cuda else 32)
    n_tiles = triton.cdiv(max_width, block_n)
    m_tiles = triton.cdiv(max_rows, block_m)
    if compact is None:
        compact = EXPAND_COMPACT_GRID and widths is not None
    if compact:
        if widths is None or len(widths) != p:
            raise ValueError(f"the compact grid needs the width of each of the {p} slices")
        grid = (
            compact_row_tiles(t, max_rows, num_slots, block_m),
            sum(triton.cdiv(w, block_n) for w in widths),
            1,
        )
    else:
        grid = (num_slots, m_tiles, p * n_tiles)
    _lora_expand_kernel[grid](
        buf, lora_b, y, slot_runs, ranks, bounds,
        rank, p, n_tiles, slot_cols, num_slots,
        slot_runs.stride(0),
        buf.stride(0), buf.stride(1),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, IEEE=lora_b.dtype == torch.float32,
        COMPACT=compact, S_P2=triton.next_power_of_2(num_slots), P_P2=triton.next_power_of_2(p),
    )  # fmt: skip
