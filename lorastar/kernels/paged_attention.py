"""Paged attention: write K/V into the block cache, and attend through block tables.

Cache layout (both K and V): ``[num_blocks, block_size, num_kv_heads, head_dim]``; token at flat
slot ``s`` lives in block ``s // block_size`` at offset ``s % block_size``. Sequence ``b``'s
position ``p`` lives in block ``block_tables[b, p // block_size]``.

Two Triton kernels, both with online softmax in fp32 and K/V read through the block table:

* decode (every sequence has one new token): one program per (sequence, kv head) computes the
  ``G = Hq / Hkv`` query heads of that group together (one K/V read serves all of them, and
  the group is padded to 16 rows so ``tl.dot`` runs on tensor cores). Long contexts with too few
  programs to fill the GPU are split over the context (split-K) and merged by a reduce kernel.
* prefill / chunked prefill / mixed: one program per (sequence, tile of query rows, query head),
  causal mask on absolute positions, so chunks with prior context in the cache work too.

Sliding windows (``sliding_window`` w > 0) start each row's key loop at its window, so block-table
entries wholly before every row's window are never read (the block manager may have freed them);
attention-logit soft-capping (``softcap`` c > 0, Gemma 2) maps scores through ``c * tanh(s / c)``.

FP8 caches (e4m3 / e5m2) convert exactly to the query dtype after the load; ``k_scale`` folds
into the softmax scale and ``v_scale`` multiplies the output (scales are ignored for 16/32-bit caches).
"""

from __future__ import annotations

import torch

from lorastar.kernels._triton import HAS_TRITON, is_fp8, num_sms, tl, triton

_LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# Cache write (plain torch: one index_copy_ per cache, works on CPU and GPU, graph-capturable)
# ---------------------------------------------------------------------------------------------


def _to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if not is_fp8(dtype):
        return x.to(dtype)
    xf = x.float()
    if scale != 1.0:
        xf = xf / scale
    fmax = torch.finfo(dtype).max
    # Saturate like the CUDA cast with SATFINITE: torch's cast would turn overflow into NaN.
    return xf.clamp_(-fmax, fmax).to(dtype)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store this step's K/V in the paged cache.

    Semantics: ``k_cache.view(-1, Hkv, D)[slot_mapping[t]] = key[t] / k_scale`` (same for V;
    the division only for FP8 caches, saturating at the format's max).

    Args:
        key, value: ``[T, Hkv, D]`` new keys / values.
        k_cache, v_cache: ``[NB, BS, Hkv, D]`` contiguous caches (model dtype or FP8).
        slot_mapping: ``[T]`` int64 flat slots ``block * BS + offset`` (all valid, >= 0).
        k_scale, v_scale: FP8 dequantization scales (ignored for 16/32-bit caches).
    """
    if key.shape[0] == 0:
        return
    nb, bs, hkv, d = k_cache.shape
    idx = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
    for src, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        flat = cache.view(nb * bs, hkv, d)  # view: writes land in the cache
        data = _to_cache_dtype(src, cache.dtype, scale)
        if is_fp8(cache.dtype):  # index_copy_ has no fp8 kernel on CPU: copy the raw bytes
            flat.view(torch.uint8).index_copy_(0, idx, data.view(torch.uint8))
        else:
            flat.index_copy_(0, idx, data)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _load_kv_tile(
        cache_ptr, blk, off_in_blk, kvh, offs_d, mask_n, mask_d,
        stride_cb, stride_cs, stride_ch, stride_cd,
        OUT_DTYPE: tl.constexpr,
    ):  # fmt: skip
        # [BLOCK_N, BLOCK_D] tile of one kv head gathered from scattered cache blocks. FP8 values
        # convert exactly to fp16/bf16/fp32; their scales are applied to the scores and the output
        # (once per row) instead of to every element.
        base = blk.to(tl.int64) * stride_cb + off_in_blk * stride_cs + kvh * stride_ch  # [BN]
        tile = tl.load(
            cache_ptr + base[:, None] + offs_d[None, :] * stride_cd,
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        return tile.to(OUT_DTYPE)

    @triton.jit
    def _softcap_log2(s, cap):
        # cap * tanh(s / cap), then into the base-2 softmax domain; tanh via exp(-2|y|) (stable
        # for any |y|, and the interpreter has no tanh).
        y = s / cap
        t = tl.exp(-2.0 * tl.abs(y))
        th = (1.0 - t) / (1.0 + t)
        return cap * tl.where(y >= 0, th, -th) * 1.4426950408889634

    # The split count is a runtime argument, never specialized (Triton would make 1 a constant):
    # one compiled decode kernel serves every batch size and context length, instead of one per
    # split count met (a JIT compile, ~0.3 s, in the middle of serving the first step that needs it).
    @triton.jit(do_not_specialize=["num_splits"])
    def _decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
        tmp_acc_ptr, tmp_m_ptr, tmp_l_ptr,
        qk_scale, v_scale, partition, window, softcap, num_splits,
        stride_qt, stride_qh, stride_qd,
        stride_cb, stride_cs, stride_ch, stride_cd,
        stride_bt,
        stride_ot, stride_oh, stride_od,
        NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        IEEE: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        q_row = tl.load(qsl_ptr + b)
        if tl.load(qsl_ptr + b + 1) == q_row:  # sequence with no token this step
            return
        seq_len = tl.load(seq_lens_ptr + b)
        ctx_lo = 0  # first key position the (single) query row sees
        if window > 0:
            ctx_lo = tl.maximum(seq_len - window, 0)
        start = ctx_lo + split * partition
        if start >= seq_len:  # nothing of this sequence in this split (the reduce masks it out)
            return
        end = tl.minimum(start + partition, seq_len)

        offs_g = tl.arange(0, BLOCK_G)
        mask_g = offs_g < GROUP
        heads = kvh * GROUP + offs_g  # query heads of this kv group
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(
            q_ptr + q_row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=mask_g[:, None] & mask_d[None, :],
            other=0.0,
        )  # [BG, BD]
        if IEEE:
            q = q.to(tl.float32)
        m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        offs_n = tl.arange(0, BLOCK_N)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + offs_n
            mask_n = pos < end
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=mask_n, other=0)
            off_in_blk = pos % BLOCK_SIZE
            k = _load_kv_tile(
                k_cache_ptr, blk, off_in_blk, kvh, offs_d, mask_n, mask_d,
                stride_cb, stride_cs, stride_ch, stride_cd, q.dtype,
            )  # fmt: skip
            v = _load_kv_tile(
                v_cache_ptr, blk, off_in_blk, kvh, offs_d, mask_n, mask_d,
                stride_cb, stride_cs, stride_ch, stride_cd, q.dtype,
            )  # fmt: skip
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            if USE_SOFTCAP:
                s = _softcap_log2(s * qk_scale, softcap)
            else:
                s = s * qk_scale
            s = tl.where(mask_n[None, :], s, float("-inf"))  # [BG, BN], log2 domain
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        acc = acc * v_scale
        if num_splits == 1:
            out = acc / l_i[:, None]
            tl.store(
                out_ptr
                + q_row.to(tl.int64) * stride_ot
                + heads[:, None] * stride_oh
                + offs_d[None, :] * stride_od,
                out.to(out_ptr.dtype.element_ty),
                mask=mask_g[:, None] & mask_d[None, :],
            )
        else:
            # Unnormalized partials; the reduce rescales them by exp2(m - max m).
            row = (b * NUM_Q_HEADS + heads) * num_splits + split  # [BG]
            tl.store(tmp_m_ptr + row, m_i, mask=mask_g)
            tl.store(tmp_l_ptr + row, l_i, mask=mask_g)
            tl.store(
                tmp_acc_ptr + row[:, None].to(tl.int64) * BLOCK_D + offs_d[None, :],
                acc,
                mask=mask_g[:, None],
            )

    @triton.jit(do_not_specialize=["num_splits"])
    def _decode_reduce_kernel(
        tmp_acc_ptr, tmp_m_ptr, tmp_l_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
        partition, window, num_splits,
        stride_ot, stride_oh, stride_od,
        NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)
        q_row = tl.load(qsl_ptr + b)
        if tl.load(qsl_ptr + b + 1) == q_row:
            return
        seq_len = tl.load(seq_lens_ptr + b)
        span = seq_len
        if window > 0:
            span = tl.minimum(seq_len, window)
        num_valid = tl.cdiv(span, partition)  # splits that saw any context (others wrote nothing)
        offs_s = tl.arange(0, BLOCK_S)
        mask_s = (offs_s < num_valid) & (offs_s < num_splits)
        row = (b * NUM_Q_HEADS + h) * num_splits + offs_s
        m = tl.load(tmp_m_ptr + row, mask=mask_s, other=float("-inf"))
        l = tl.load(tmp_l_ptr + row, mask=mask_s, other=0.0)  # noqa: E741
        offs_d = tl.arange(0, BLOCK_D)
        acc = tl.load(
            tmp_acc_ptr + row[:, None].to(tl.int64) * BLOCK_D + offs_d[None, :],
            mask=mask_s[:, None],
            other=0.0,
        )
        w = tl.exp2(m - tl.max(m, axis=0))  # [BS]; 0 for masked splits
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
        tl.store(
            out_ptr + q_row.to(tl.int64) * stride_ot + h * stride_oh + offs_d * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=offs_d < HEAD_DIM,
        )

    @triton.jit
    def _prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
        qk_scale, v_scale, window, softcap,
        stride_qt, stride_qh, stride_qd,
        stride_cb, stride_cs, stride_ch, stride_cd,
        stride_bt,
        stride_ot, stride_oh, stride_od,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        IEEE: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        pid_m = tl.program_id(1)
        h = tl.program_id(2)
        q_start = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
        if pid_m * BLOCK_M >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + b)
        ctx_before = seq_len - q_len  # tokens already in the cache before this chunk
        kvh = h // GROUP

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < q_len
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(
            q_ptr
            + (q_start + offs_m).to(tl.int64)[:, None] * stride_qt
            + h * stride_qh
            + offs_d[None, :] * stride_qd,
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )  # [BM, BD]
        if IEEE:
            q = q.to(tl.float32)
        q_pos = ctx_before + offs_m  # absolute positions of these rows
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        offs_n = tl.arange(0, BLOCK_N)
        # Causal: the last row of this tile sees keys up to its own position, nothing beyond.
        hi = tl.minimum(seq_len, ctx_before + (pid_m + 1) * BLOCK_M)
        # Sliding window: the first row of this tile sees nothing before its own window.
        lo = 0
        if window > 0:
            lo = tl.maximum(ctx_before + pid_m * BLOCK_M - window + 1, 0)
        for n0 in range(lo, hi, BLOCK_N):
            pos = n0 + offs_n
            mask_n = pos < hi
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=mask_n, other=0)
            off_in_blk = pos % BLOCK_SIZE
            k = _load_kv_tile(
                k_cache_ptr, blk, off_in_blk, kvh, offs_d, mask_n, mask_d,
                stride_cb, stride_cs, stride_ch, stride_cd, q.dtype,
            )  # fmt: skip
            v = _load_kv_tile(
                v_cache_ptr, blk, off_in_blk, kvh, offs_d, mask_n, mask_d,
                stride_cb, stride_cs, stride_ch, stride_cd, q.dtype,
            )  # fmt: skip
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            visible = mask_n[None, :] & (pos[None, :] <= q_pos[:, None])
            if window > 0:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
            if USE_SOFTCAP:
                s = _softcap_log2(s * qk_scale, softcap)
            else:
                s = s * qk_scale
            s = tl.where(visible, s, float("-inf"))  # [BM, BN]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row may see no key of a tile before its window opens: keep exp2 away from -inf - -inf.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        # Rows past q_len (never stored) may have seen no key at all: no 0 / 0 for them.
        out = acc * v_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr
            + (q_start + offs_m).to(tl.int64)[:, None] * stride_ot
            + h * stride_oh
            + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


_MAX_SPLITS = 64  # also the reduce's one tile of splits: a single compiled reduce for any count


def _decode_splits(
    batch: int, num_kv_heads: int, max_seq_len: int, block_n: int, device: torch.device
) -> int:
    """Split the context only when (seq, kv head) programs alone cannot fill the GPU."""
    if device.type != "cuda":
        return 1
    programs = batch * num_kv_heads
    sms = num_sms(device)
    if programs >= sms or max_seq_len <= 4 * block_n:
        return 1
    want = triton.cdiv(2 * sms, programs)
    return max(1, min(want, triton.cdiv(max_seq_len, 2 * block_n), _MAX_SPLITS))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each sequence's new query rows over its paged KV cache (Triton).

    Semantics: ``for b: rows = qsl[b]:qsl[b+1]; L = seq_lens[b]; K = gather(k_cache, block_tables[b], L) * k_scale;``
    ``out[rows] = softmax(cap(scale * q[rows] @ K.T) + causal(L - len(rows), w), -1) @ V`` (GQA: head h reads
    kv head h // G; ``cap(s) = c * tanh(s / c)`` when ``softcap`` c > 0; row at position p sees keys
    ``max(0, p - w + 1)..p`` when ``sliding_window`` w > 0, else ``0..p``).

    Args:
        q: ``[T, Hq, D]`` queries (any strides).
        k_cache, v_cache: ``[NB, BS, Hkv, D]`` paged caches (model dtype or FP8); this step's
            K/V already written (``reshape_and_cache``).
        block_tables: ``[B, MB]`` int32 block ids per sequence.
        seq_lens: ``[B]`` int32 context length after this step (new tokens included).
        query_start_loc: ``[B + 1]`` int32 row offsets of each sequence in ``q``.
        scale: softmax scale (usually ``D ** -0.5``).
        max_query_len: longest ``q_len`` (1 selects the decode kernel).
        max_seq_len: longest ``seq_lens`` entry (sizes the decode split-K).
        k_scale, v_scale: FP8 dequantization scales.
        out: optional ``[T, Hq, D]`` output buffer.
        num_splits: force the decode kernel's context splits (tests); ``None`` picks.
        sliding_window: keys per row (0: unlimited); entries of ``block_tables`` before every row's
            window are never read (they may be freed blocks).
        softcap: attention-logit soft-capping (0: none).

    Returns:
        ``[T, Hq, D]`` in ``q.dtype`` (or ``out``). Rows past ``query_start_loc[B]`` are not written.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if out is None:
        out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    fp8 = is_fp8(k_cache.dtype)
    if not fp8:  # scales describe FP8 storage only
        k_scale = v_scale = 1.0
    ieee = q.dtype == torch.float32  # fp32 models get exact fp32 dots, not tf32
    # Softmax in base 2; the FP8 key scale folds in here: (q . k * ks) * scale = q . k * (ks * scale).
    use_softcap = softcap > 0
    qk_scale = float(scale) * float(k_scale) * (1.0 if use_softcap else _LOG2E)  # softcap: log2 after tanh
    window = max(0, int(sliding_window))
    span = min(max_seq_len, window) if window else max_seq_len  # keys the longest decode row reads
    on_gpu = q.is_cuda
    common_strides = (
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
    )  # fmt: skip
    if v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must have the same layout")

    if max_query_len == 1:
        block_g = max(16, triton.next_power_of_2(group))
        # fp32 (ieee dots) at head dim 128 keeps the tile small to stay in registers; FP8 tiles
        # are half the bytes, so twice the tokens keep as many bytes in flight.
        if on_gpu:
            block_n = 32 if (ieee and block_d > 64) else (128 if fp8 and block_d <= 128 else 64)
        else:
            block_n = 32
        splits = num_splits or _decode_splits(batch, num_kv_heads, span, block_n, q.device)
        # Whole BLOCK_N tiles per split, so only the last split of a sequence has a ragged tile.
        partition = triton.cdiv(triton.cdiv(max(span, 1), splits), block_n) * block_n
        splits = triton.cdiv(max(span, 1), partition)
        # fp32 partials even when unused (one split): the pointer types stay those of the split
        # case, so both share one compiled kernel.
        if splits > 1:
            tmp_acc = torch.empty(batch, num_q_heads, splits, block_d, dtype=torch.float32, device=q.device)
            tmp_m = torch.empty(batch, num_q_heads, splits, dtype=torch.float32, device=q.device)
            tmp_l = torch.empty_like(tmp_m)
        else:  # never read or written (one element: a real, aligned device pointer)
            tmp_acc = tmp_m = tmp_l = torch.empty(1, dtype=torch.float32, device=q.device)
        _decode_kernel[(batch, num_kv_heads, splits)](
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
            tmp_acc, tmp_m, tmp_l,
            qk_scale, float(v_scale), partition, window, float(softcap), splits,
            *common_strides,
            NUM_Q_HEADS=num_q_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
            BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
            IEEE=ieee, USE_SOFTCAP=use_softcap,
            num_warps=4,
        )  # fmt: skip
        if splits > 1:
            _decode_reduce_kernel[(batch, num_q_heads)](
                tmp_acc, tmp_m, tmp_l, seq_lens, query_start_loc, out,
                partition, window, splits,
                out.stride(0), out.stride(1), out.stride(2),
                NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim,
                BLOCK_S=max(_MAX_SPLITS, triton.next_power_of_2(splits)), BLOCK_D=block_d,
            )  # fmt: skip
        return out

    if on_gpu:
        block_m = 64 if max_query_len > 32 else 16
        block_n = 64 if block_d <= 64 or not ieee else 32
    else:
        block_m, block_n = 16, 32  # interpreter: few, cheap programs
    grid = (batch, triton.cdiv(max_query_len, block_m), num_q_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        qk_scale, float(v_scale), window, float(softcap),
        *common_strides,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        IEEE=ieee, USE_SOFTCAP=use_softcap,
        num_warps=4,
    )  # fmt: skip
    return out
