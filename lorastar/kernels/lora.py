"""Punica-style batched multi-LoRA: shrink (``x @ A.T``) and expand (``y += buf @ B.T``).

Many adapters serve one flat token batch. Adapter weights sit in device *slots*: ``lora_a``
``[S, R, H]`` and ``lora_b`` ``[S, N, R]`` padded to the largest rank ``R``; ``ranks[s]`` is slot
``s``'s true rank and the kernels loop over rank chunks only up to it, so a rank-8 adapter batched
with a rank-64 one costs rank-8 work. Two index forms:

* BGMV (gather, decode): ``token_slots[t]`` per token, one program per token.
* SGMV (segments, prefill): runs of consecutive tokens with one slot; tiles of rows use ``tl.dot``.

Each op runs its Triton kernel when the tensors are on CUDA (or when ``force_triton=True`` / the
module flag ``FORCE_TRITON`` is set, for tests under ``TRITON_INTERPRET=1``); otherwise a
vectorized torch path that groups rows by slot (``lora_shrink_torch`` / ``lora_expand_torch``).
A fused linear's entry points (``add_lora``, ``add_lora_cpu``) live in ``layers/lora.py``.
"""

from __future__ import annotations

import torch

from lorastar.kernels._triton import HAS_TRITON, num_sms, tl, triton

# Tests flip this to run the Triton kernels on CPU tensors under TRITON_INTERPRET=1.
FORCE_TRITON = False

Groups = list[tuple[int, torch.Tensor]]


def _use_triton(t: torch.Tensor, force: bool) -> bool:
    return HAS_TRITON and (t.is_cuda or force or FORCE_TRITON)


# ---------------------------------------------------------------------------------------------
# Torch path (CPU): one matmul per distinct adapter in the batch
# ---------------------------------------------------------------------------------------------


def groups_from_slots(token_slots: torch.Tensor) -> Groups:
    """``[(slot, rows)]`` for each distinct slot >= 0 in ``token_slots`` (rows: int64 indices)."""
    slots = token_slots.to(torch.int64)
    out: Groups = []
    for s in torch.unique(slots).tolist():
        if s >= 0:
            out.append((int(s), torch.nonzero(slots == s).flatten()))
    return out


def groups_from_segments(seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> Groups:
    """``[(slot, rows)]`` merging all segments of one slot (slot -1 skipped)."""
    starts = seg_starts.tolist()
    by_slot: dict[int, list[torch.Tensor]] = {}
    for g, s in enumerate(seg_slots.tolist()):
        if s >= 0 and starts[g + 1] > starts[g]:
            by_slot.setdefault(int(s), []).append(
                torch.arange(starts[g], starts[g + 1], device=seg_starts.device)
            )
    return [(s, torch.cat(rows)) for s, rows in by_slot.items()]


def _rank_list(ranks: torch.Tensor | list[int]) -> list[int]:
    return ranks.tolist() if isinstance(ranks, torch.Tensor) else list(ranks)


def lora_shrink_torch(
    x: torch.Tensor,  # [T, H]
    lora_a: torch.Tensor,  # [S, R, H]
    out: torch.Tensor,  # [T, R], pre-zeroed by the caller
    groups: Groups,
    ranks: torch.Tensor | list[int],  # [S]
    scale: float = 1.0,
) -> None:
    """Torch shrink. Semantics: ``for s, rows in groups: out[rows, :r] = scale * x[rows] @ A[s, :r].T``."""
    rank_of = _rank_list(ranks)
    for slot, rows in groups:
        r = rank_of[slot]
        if r == 0 or rows.numel() == 0:
            continue
        a = lora_a[slot, :r].to(x.dtype)  # [r, H]
        if rows.numel() == x.shape[0]:  # one adapter for the whole batch: no gather/scatter
            res = x @ a.t()
            if scale != 1.0:
                res = res * scale
            out[:, :r] = res.to(out.dtype)
        else:
            res = x.index_select(0, rows) @ a.t()  # [n, r]
            if scale != 1.0:
                res = res * scale
            out[rows, :r] = res.to(out.dtype)


def lora_expand_torch(
    buf: torch.Tensor,  # [T, R]
    lora_b: torch.Tensor,  # [S, N, R]
    y: torch.Tensor,  # [T, Ntot]
    groups: Groups,
    ranks: torch.Tensor | list[int],  # [S]
    offset: int,
) -> None:
    """Torch expand. Semantics: ``for s, rows in groups: y[rows, off:off+N] += buf[rows, :r] @ B[s, :, :r].T``."""
    rank_of = _rank_list(ranks)
    n = lora_b.shape[1]
    y_cols = y[:, offset : offset + n]  # view: index_add_ writes through
    for slot, rows in groups:
        r = rank_of[slot]
        if r == 0 or rows.numel() == 0:
            continue
        b = lora_b[slot, :, :r].to(y.dtype)  # [N, r]
        if rows.numel() == y.shape[0]:
            y_cols += buf[:, :r].to(y.dtype) @ b.t()
        else:
            y_cols.index_add_(0, rows, buf.index_select(0, rows)[:, :r].to(y.dtype) @ b.t())


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _bgmv_shrink_kernel(
        x_ptr, a_ptr, out_ptr, slots_ptr, ranks_ptr,
        H, scale,
        stride_xt, stride_xh,
        stride_as, stride_ar, stride_ah,
        stride_ot, stride_or,
        K_PER_SPLIT,
        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
    ):  # fmt: skip
        # One program per (token, split of H). GEMV: rank rows of A times one x row (no tl.dot:
        # a single token has no M dimension worth a tensor-core tile).
        t = tl.program_id(0)
        pid_k = tl.program_id(1)
        slot = tl.load(slots_ptr + t)
        if slot < 0:
            return
        rank = tl.load(ranks_ptr + slot)
        k_start = pid_k * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, H)
        offs_r = tl.arange(0, BLOCK_R)
        offs_k = tl.arange(0, BLOCK_K)
        a_base = a_ptr + slot.to(tl.int64) * stride_as
        x_base = x_ptr + t.to(tl.int64) * stride_xt
        # Loop only over this adapter's rank: smaller adapters in a mixed batch cost less.
        for r0 in range(0, rank, BLOCK_R):
            rr = r0 + offs_r
            r_mask = rr < rank
            # Elementwise partial products; one reduction per rank chunk, not per K step.
            acc2 = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
            for k0 in range(k_start, k_end, BLOCK_K):
                kk = k0 + offs_k
                k_mask = kk < k_end
                xv = tl.load(x_base + kk * stride_xh, mask=k_mask, other=0.0).to(tl.float32)  # [BK]
                av = tl.load(
                    a_base + rr[:, None] * stride_ar + kk[None, :] * stride_ah,
                    mask=r_mask[:, None] & k_mask[None, :],
                    other=0.0,
                ).to(tl.float32)  # [BR, BK]
                acc2 += av * xv[None, :]
            acc = tl.sum(acc2, axis=1) * scale  # [BR]
            o_ptrs = out_ptr + t.to(tl.int64) * stride_ot + rr * stride_or
            if ATOMIC:
                tl.atomic_add(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=r_mask)
            else:
                tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=r_mask)

    @triton.jit
    def _bgmv_expand_kernel(
        buf_ptr, b_ptr, y_ptr, slots_ptr, ranks_ptr,
        N, offset,
        stride_bt, stride_br,
        stride_bs, stride_bn, stride_bk,
        stride_yt, stride_yn,
        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        # One program per (token, tile of N output columns); each y element has one owner.
        t = tl.program_id(0)
        pid_n = tl.program_id(1)
        slot = tl.load(slots_ptr + t)
        if slot < 0:
            return
        rank = tl.load(ranks_ptr + slot)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_r = tl.arange(0, BLOCK_R)
        b_base = b_ptr + slot.to(tl.int64) * stride_bs
        acc2 = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            rr = r0 + offs_r
            r_mask = rr < rank
            bv = tl.load(buf_ptr + t.to(tl.int64) * stride_bt + rr * stride_br, mask=r_mask, other=0.0)
            wv = tl.load(
                b_base + offs_n[:, None] * stride_bn + rr[None, :] * stride_bk,
                mask=n_mask[:, None] & r_mask[None, :],
                other=0.0,
            )  # [BN, BR]
            acc2 += wv.to(tl.float32) * bv.to(tl.float32)[None, :]
        acc = tl.sum(acc2, axis=1)  # [BN]
        y_ptrs = y_ptr + t.to(tl.int64) * stride_yt + (offset + offs_n) * stride_yn
        yv = tl.load(y_ptrs, mask=n_mask, other=0.0)
        tl.store(y_ptrs, (yv.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=n_mask)

    @triton.jit
    def _sgmv_shrink_kernel(
        x_ptr, a_ptr, out_ptr, seg_starts_ptr, seg_slots_ptr, ranks_ptr,
        H, scale,
        stride_xt, stride_xh,
        stride_as, stride_ar, stride_ah,
        stride_ot, stride_or,
        K_PER_SPLIT,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
        ATOMIC: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        # One program per (segment, tile of BLOCK_M rows, split of H); tiles past the segment exit.
        g = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        slot = tl.load(seg_slots_ptr + g)
        if slot < 0:
            return
        seg_start = tl.load(seg_starts_ptr + g)
        seg_end = tl.load(seg_starts_ptr + g + 1)
        m_start = seg_start + pid_m * BLOCK_M
        if m_start >= seg_end:
            return
        rank = tl.load(ranks_ptr + slot)
        k_start = pid_k * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, H)
        offs_m = m_start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < seg_end
        offs_r = tl.arange(0, BLOCK_R)
        offs_k = tl.arange(0, BLOCK_K)
        a_base = a_ptr + slot.to(tl.int64) * stride_as
        for r0 in range(0, rank, BLOCK_R):
            rr = r0 + offs_r
            r_mask = rr < rank
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k0 in range(k_start, k_end, BLOCK_K):
                kk = k0 + offs_k
                k_mask = kk < k_end
                xv = tl.load(
                    x_ptr + offs_m[:, None].to(tl.int64) * stride_xt + kk[None, :] * stride_xh,
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
            acc = acc * scale
            o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_ot + rr[None, :] * stride_or
            o_mask = m_mask[:, None] & r_mask[None, :]
            if ATOMIC:
                tl.atomic_add(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
            else:
                tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)

    @triton.jit
    def _sgmv_expand_kernel(
        buf_ptr, b_ptr, y_ptr, seg_starts_ptr, seg_slots_ptr, ranks_ptr,
        N, offset,
        stride_bt, stride_br,
        stride_bs, stride_bn, stride_bk,
        stride_yt, stride_yn,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        # One program per (segment, tile of rows, tile of N columns).
        g = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_n = tl.program_id(2)
        slot = tl.load(seg_slots_ptr + g)
        if slot < 0:
            return
        seg_start = tl.load(seg_starts_ptr + g)
        seg_end = tl.load(seg_starts_ptr + g + 1)
        m_start = seg_start + pid_m * BLOCK_M
        if m_start >= seg_end:
            return
        rank = tl.load(ranks_ptr + slot)
        offs_m = m_start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < seg_end
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_r = tl.arange(0, BLOCK_R)
        b_base = b_ptr + slot.to(tl.int64) * stride_bs
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            rr = r0 + offs_r
            r_mask = rr < rank
            bv = tl.load(
                buf_ptr + offs_m[:, None].to(tl.int64) * stride_bt + rr[None, :] * stride_br,
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
        y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_yt + (offset + offs_n)[None, :] * stride_yn
        y_mask = m_mask[:, None] & n_mask[None, :]
        yv = tl.load(y_ptrs, mask=y_mask, other=0.0)
        tl.store(y_ptrs, (yv.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


_BLOCK_R = 16  # rank chunk; tl.dot needs >= 16 on NVIDIA, the tail of the last chunk is masked


def _split_k(num_rows_programs: int, h: int, block_k: int, device: torch.device, allow: bool) -> int:
    """How many slices of H to give each row program so the GPU has enough programs in flight."""
    if not allow or device.type != "cuda":
        return 1
    want = max(1, (4 * num_sms(device)) // max(num_rows_programs, 1))
    return max(1, min(want, triton.cdiv(h, block_k), 32))


def _k_per_split(h: int, split: int, block_k: int) -> int:
    # Splits are whole multiples of BLOCK_K so no BLOCK_K tile straddles two programs.
    return triton.cdiv(triton.cdiv(h, split), block_k) * block_k


def _check_out_atomic(out: torch.Tensor) -> bool:
    # Split-K accumulates with atomics: fp32 output only (fp16 atomics lose too much on large H).
    return out.dtype == torch.float32


def bgmv_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    out: torch.Tensor,
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
    scale: float = 1.0,
    *,
    force_triton: bool = False,
    split_k: int | None = None,
    block_k: int | None = None,
) -> None:
    """Per-token LoRA shrink (punica BGMV).

    Semantics: ``for t: s = token_slots[t]; if s >= 0: out[t, :ranks[s]] = scale * x[t] @ lora_a[s, :ranks[s]].T``

    Args:
        x: ``[T, H]`` activations.
        lora_a: ``[S, R, H]`` A weights per slot (padded to the max rank ``R``).
        out: ``[T, R]`` output, pre-zeroed by the caller; rows with ``s = -1`` and columns past
            the slot's rank are left untouched.
        token_slots: ``[T]`` int32 slot per token, -1 = no adapter.
        ranks: ``[S]`` int32 true rank per slot.
        scale: multiplies the result.
        split_k: slices of ``H`` per token (needs an fp32 ``out``; atomics); ``None`` picks one.
    """
    if x.shape[0] == 0:
        return
    if not _use_triton(x, force_triton):
        lora_shrink_torch(x, lora_a, out, groups_from_slots(token_slots), ranks, scale)
        return
    t, h = x.shape
    block_k = block_k or (128 if x.is_cuda else 64)
    allow = _check_out_atomic(out)
    split = split_k if (split_k is not None and allow) else _split_k(t, h, block_k, x.device, allow)
    kps = _k_per_split(h, split, block_k)
    split = triton.cdiv(h, kps)
    _bgmv_shrink_kernel[(t, split)](
        x, lora_a, out, token_slots, ranks,
        h, float(scale),
        x.stride(0), x.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        out.stride(0), out.stride(1),
        kps,
        BLOCK_R=_BLOCK_R, BLOCK_K=block_k, ATOMIC=split > 1,
    )  # fmt: skip


def bgmv_expand(
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    y: torch.Tensor,
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
    offset: int,
    *,
    force_triton: bool = False,
    block_n: int | None = None,
) -> None:
    """Per-token LoRA expand (punica BGMV), accumulating into a column slice of ``y``.

    Semantics: ``for t: s = token_slots[t]; r = ranks[s]; if s >= 0: y[t, offset:offset+N] += buf[t, :r] @ lora_b[s, :, :r].T``

    Args:
        buf: ``[T, R]`` shrink output.
        lora_b: ``[S, N, R]`` B weights per slot (scaling already folded in).
        y: ``[T, Ntot]`` output, updated in place at columns ``offset:offset+N``.
        token_slots: ``[T]`` int32, -1 = no adapter (row untouched).
        ranks: ``[S]`` int32.
        offset: first column of this slice in ``y``.
    """
    if buf.shape[0] == 0:
        return
    if not _use_triton(buf, force_triton):
        lora_expand_torch(buf, lora_b, y, groups_from_slots(token_slots), ranks, offset)
        return
    t = buf.shape[0]
    n = lora_b.shape[1]
    # 32 columns per program measured best on H100 (64 tokens x rank 64: 22.6 us vs 39 us at 128).
    block_n = block_n or (32 if buf.is_cuda else 64)
    _bgmv_expand_kernel[(t, triton.cdiv(n, block_n))](
        buf, lora_b, y, token_slots, ranks,
        n, offset,
        buf.stride(0), buf.stride(1),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_N=block_n, BLOCK_R=_BLOCK_R,
    )  # fmt: skip


def sgmv_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    out: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    ranks: torch.Tensor,
    scale: float = 1.0,
    *,
    max_seg_len: int | None = None,
    force_triton: bool = False,
    split_k: int | None = None,
) -> None:
    """Segmented LoRA shrink (punica SGMV): rows of one segment share an adapter.

    Semantics: ``for g: rows = seg_starts[g]:seg_starts[g+1]; s = seg_slots[g]; if s >= 0: out[rows, :ranks[s]] = scale * x[rows] @ lora_a[s, :ranks[s]].T``

    Args:
        x: ``[T, H]``; lora_a: ``[S, R, H]``; out: ``[T, R]`` pre-zeroed.
        seg_starts: ``[G + 1]`` int32 row offsets; seg_slots: ``[G]`` int32 (-1 = skip).
        ranks: ``[S]`` int32.
        max_seg_len: longest segment if known on the host (bounds the grid); ``None`` uses ``T``.
    """
    if x.shape[0] == 0 or seg_slots.shape[0] == 0:
        return
    if not _use_triton(x, force_triton):
        lora_shrink_torch(x, lora_a, out, groups_from_segments(seg_starts, seg_slots), ranks, scale)
        return
    t, h = x.shape
    block_m, block_k = 16, (64 if x.is_cuda else 32)
    m_tiles = triton.cdiv(max_seg_len if max_seg_len is not None else t, block_m)
    allow = _check_out_atomic(out)
    num_segs = seg_slots.shape[0]
    split = (
        split_k
        if (split_k is not None and allow)
        else _split_k(num_segs * m_tiles, h, block_k, x.device, allow)
    )
    kps = _k_per_split(h, split, block_k)
    split = triton.cdiv(h, kps)
    _sgmv_shrink_kernel[(num_segs, m_tiles, split)](
        x, lora_a, out, seg_starts, seg_slots, ranks,
        h, float(scale),
        x.stride(0), x.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        out.stride(0), out.stride(1),
        kps,
        BLOCK_M=block_m, BLOCK_R=_BLOCK_R, BLOCK_K=block_k,
        ATOMIC=split > 1, IEEE=x.dtype == torch.float32,
    )  # fmt: skip


def sgmv_expand(
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    y: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    ranks: torch.Tensor,
    offset: int,
    *,
    max_seg_len: int | None = None,
    force_triton: bool = False,
    block_m: int | None = None,
    block_r: int | None = None,
) -> None:
    """Segmented LoRA expand (punica SGMV) into a column slice of ``y``.

    Semantics: ``for g: rows = seg_starts[g]:seg_starts[g+1]; s = seg_slots[g]; r = ranks[s]; if s >= 0: y[rows, offset:offset+N] += buf[rows, :r] @ lora_b[s, :, :r].T``

    Args:
        buf: ``[T, R]``; lora_b: ``[S, N, R]``; y: ``[T, Ntot]`` updated in place.
        seg_starts: ``[G + 1]`` int32; seg_slots: ``[G]`` int32 (-1 = skip); ranks: ``[S]`` int32.
        offset: first column of this slice in ``y``.
        max_seg_len: longest segment if known on the host; ``None`` uses ``T``.
    """
    if buf.shape[0] == 0 or seg_slots.shape[0] == 0:
        return
    if not _use_triton(buf, force_triton):
        lora_expand_torch(buf, lora_b, y, groups_from_segments(seg_starts, seg_slots), ranks, offset)
        return
    t = buf.shape[0]
    n = lora_b.shape[1]
    rows = max_seg_len if max_seg_len is not None else t
    # Prefill-sized segments: 64-row x 32-rank tiles re-read B less often (H100 sweep, 2048 tokens,
    # rank 64: 34 us vs 104 us with 16 x 16). Small batches keep 16-row tiles (more programs).
    big = buf.is_cuda and rows >= 256
    block_m = block_m or (64 if big else 16)
    block_r = block_r or (32 if big else _BLOCK_R)
    block_n = 64 if buf.is_cuda else 32
    m_tiles = triton.cdiv(rows, block_m)
    _sgmv_expand_kernel[(seg_slots.shape[0], m_tiles, triton.cdiv(n, block_n))](
        buf, lora_b, y, seg_starts, seg_slots, ranks,
        n, offset,
        buf.stride(0), buf.stride(1),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, IEEE=lora_b.dtype == torch.float32,
    )  # fmt: skip
