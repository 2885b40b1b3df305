"""Plain, obviously-correct torch versions of every kernel op (test oracles; loops are fine here).

Each function mirrors the semantics of the fast op of the same name without ``ref_``. They favour
clarity over speed: per-sequence / per-token Python loops, fp32 math, no in-place tricks.
"""

from __future__ import annotations

import torch

from lorastar.kernels._triton import is_fp8

# ---------------------------------------------------------------------------------------------
# Paged KV cache + attention
# ---------------------------------------------------------------------------------------------


def ref_reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, block * BS + offset
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write token ``t``'s K/V at block ``slot // BS``, offset ``slot % BS`` (FP8: value / scale)."""
    block_size = k_cache.shape[1]
    for t in range(key.shape[0]):
        slot = int(slot_mapping[t])
        if slot < 0:  # padding token: nothing to store
            continue
        blk, off = divmod(slot, block_size)
        if is_fp8(k_cache.dtype):  # saturate at the format's max (no inf/NaN from overflow)
            fmax = torch.finfo(k_cache.dtype).max
            k_cache[blk, off] = (key[t].float() / k_scale).clamp(-fmax, fmax).to(k_cache.dtype)
            v_cache[blk, off] = (value[t].float() / v_scale).clamp(-fmax, fmax).to(v_cache.dtype)
        else:
            k_cache[blk, off] = key[t].to(k_cache.dtype)
            v_cache[blk, off] = value[t].to(v_cache.dtype)


def ref_paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, MB] int32
    seq_lens: torch.Tensor,  # [B] int32, context length after this step
    query_start_loc: torch.Tensor,  # [B + 1] int32
    *,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each sequence's new query rows over its paged context, in fp32.

    Row ``i`` of sequence ``b`` (``q_len`` new rows) sits at position ``p = seq_lens[b] - q_len + i``
    and attends to positions ``0..p`` (with ``sliding_window`` w > 0: ``p - w + 1..p``, as
    transformers' ``kv_idx > q_idx - w``; block-table entries before that are never read). GQA: query
    head ``h`` reads kv head ``h // G``. ``softcap`` c > 0: scores become ``c * tanh(scores / c)``.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if not is_fp8(k_cache.dtype):  # scales describe FP8 storage only
        k_scale = v_scale = 1.0
    result = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    for b in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        q_len, ctx = end - start, int(seq_lens[b])
        if q_len == 0:
            continue
        # Gather the context one position at a time: obviously right, no index arithmetic tricks.
        keys, vals = [], []
        lo = max(0, ctx - q_len - sliding_window + 1) if sliding_window > 0 else 0
        for pos in range(ctx):
            if pos < lo:  # outside every row's window (its block may be freed): zeros, masked below
                keys.append(torch.zeros_like(k_cache[0, 0], dtype=torch.float32))
                vals.append(torch.zeros_like(v_cache[0, 0], dtype=torch.float32))
                continue
            blk = int(block_tables[b, pos // block_size])
            keys.append(k_cache[blk, pos % block_size].float() * k_scale)  # [Hkv, D]
            vals.append(v_cache[blk, pos % block_size].float() * v_scale)
        k = torch.stack(keys).repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = torch.stack(vals).repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        qb = q[start:end].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale  # [Hq, q_len, ctx]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        hidden = k_pos > q_pos
        if sliding_window > 0:
            hidden = hidden | (k_pos <= q_pos - sliding_window)
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        result[start:end] = torch.einsum("hqk,khd->qhd", probs, v)
    result = result.to(q.dtype)
    if out is not None:
        out.copy_(result)
        return out
    return result


# ---------------------------------------------------------------------------------------------
# Multi-LoRA: per token (the CPU path's semantics) and over slot runs (the Triton kernels)
# ---------------------------------------------------------------------------------------------


def ref_lora_shrink(
    x: torch.Tensor,  # [T, H]
    lora_a: torch.Tensor,  # [S, R, H]
    token_slots: torch.Tensor,  # [T] int32, -1 = no adapter
    ranks: torch.Tensor,  # [S] int32
    scale: float = 1.0,
) -> torch.Tensor:
    """``out[t, :r] = scale * x[t] @ lora_a[s, :r].T`` for ``s = token_slots[t] >= 0``; zero elsewhere.

    Returns ``out`` [T, R] in ``x.dtype`` (computed in fp32).
    """
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        s = int(token_slots[t])
        if s < 0:
            continue
        r = int(ranks[s])
        out[t, :r] = scale * (lora_a[s, :r].float() @ x[t].float())
    return out.to(x.dtype)


def ref_lora_expand(
    y: torch.Tensor,  # [T, Ntot]
    buf: torch.Tensor,  # [T, R]
    lora_b: torch.Tensor,  # [S, N, R]
    token_slots: torch.Tensor,  # [T] int32, -1 = no adapter
    ranks: torch.Tensor,  # [S] int32
    offset: int,
) -> torch.Tensor:
    """Return a new ``y`` with ``y[t, offset:offset+N] += buf[t, :r] @ lora_b[s, :, :r].T``.

    ``r = ranks[s]``; rows with ``s = -1`` are unchanged. Sum in fp32, cast back to ``y.dtype``.
    """
    new_y = y.clone()
    n = lora_b.shape[1]
    for t in range(y.shape[0]):
        s = int(token_slots[t])
        if s < 0:
            continue
        r = int(ranks[s])
        delta = lora_b[s, :, :r].float() @ buf[t, :r].float()  # [N]
        new_y[t, offset : offset + n] = (y[t, offset : offset + n].float() + delta).to(y.dtype)
    return new_y


def ref_lora_shrink_runs(
    x: torch.Tensor,  # [T, H]
    lora_a: torch.Tensor,  # [S, P * R, H]
    slot_runs: torch.Tensor,  # [2, S] int32 (start, count)
    ranks: torch.Tensor,  # [S, P] int32
) -> torch.Tensor:
    """``kernels/lora.lora_shrink``: ``out[rows_s, i*R : i*R + r] = x[rows_s] @ lora_a[s, i*R : i*R + r].T``
    for each slot ``s`` and slice ``i`` (``r = ranks[s, i]``); zero elsewhere. Returns fp32 ``[T, P * R]``."""
    num_slots, p = ranks.shape
    width = lora_a.shape[1] // p
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for s in range(num_slots):
        start, count = int(slot_runs[0, s]), int(slot_runs[1, s])
        for i in range(p):
            r, c = int(ranks[s, i]), i * width
            for t in range(start, start + count):
                out[t, c : c + r] = lora_a[s, c : c + r].float() @ x[t].float()
    return out


def ref_lora_expand_runs(
    y: torch.Tensor,  # [T, Ntot]
    buf: torch.Tensor,  # [T, P * R], or [T, S * P * R] with slot_cols = P * R
    lora_b: torch.Tensor,  # [S, Ntot, R]
    slot_runs: torch.Tensor,  # [2, S] int32
    ranks: torch.Tensor,  # [S, P] int32
    bounds: torch.Tensor,  # [P + 1] int32
    slot_cols: int = 0,
) -> torch.Tensor:
    """``kernels/lora.lora_expand``: a new ``y`` with ``y[rows_s, lo:hi] += buf[rows_s, c : c + r] @ lora_b[s, lo:hi, :r].T``
    for each slot ``s`` and slice ``i`` (``lo, hi = bounds[i], bounds[i + 1]``, ``c = s * slot_cols + i * R``).
    Sum in fp32."""
    num_slots, p = ranks.shape
    width = lora_b.shape[2]
    new_y = y.clone()
    for s in range(num_slots):
        start, count = int(slot_runs[0, s]), int(slot_runs[1, s])
        for i in range(p):
            r, c, lo, hi = int(ranks[s, i]), s * slot_cols + i * width, int(bounds[i]), int(bounds[i + 1])
            for t in range(start, start + count):
                delta = lora_b[s, lo:hi, :r].float() @ buf[t, c : c + r].float()
                new_y[t, lo:hi] = (y[t, lo:hi].float() + delta).to(y.dtype)
    return new_y


# ---------------------------------------------------------------------------------------------
# Quantized weights (AWQ / GPTQ int4-int8, FP8). Owned by the quant issue; appended here.
# ---------------------------------------------------------------------------------------------

# AutoAWQ packs 8 output columns per int32 with ``order_map = [0, 2, 4, 6, 1, 3, 5, 7]``: nibble ``i``
# holds column ``order_map[i]``. So column ``j`` sits in nibble ``AWQ_REVERSE_ORDER[j]``.
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def ref_awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` int32 (AWQ order, 4-bit) -> ``[R, C * 8]`` int32 values in ``0..15``."""
    cols = []
    for j in range(8):
        cols.append((packed >> (4 * AWQ_REVERSE_ORDER[j])) & 0xF)  # [R, C] column 8c + j
    return torch.stack(cols, dim=-1).reshape(packed.shape[0], packed.shape[1] * 8)


def ref_gptq_unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ ``qweight`` ``[K * bits / 32, N]`` -> ``[K, N]``: row ``r`` holds input rows
    ``r * (32 / bits) + i`` at bit offset ``i * bits`` (plain sequential order)."""
    per = 32 // bits
    mask = (1 << bits) - 1
    rows = [(packed >> (bits * i)) & mask for i in range(per)]  # each [R, N]
    return torch.stack(rows, dim=1).reshape(packed.shape[0] * per, packed.shape[1])


def ref_gptq_unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ ``qzeros`` ``[G, N * bits / 32]`` -> ``[G, N]`` (sequential order along columns)."""
    per = 32 // bits
    mask = (1 << bits) - 1
    cols = [(packed >> (bits * i)) & mask for i in range(per)]  # each [G, C]
    return torch.stack(cols, dim=-1).reshape(packed.shape[0], packed.shape[1] * per)


def ref_awq_dequant(
    qweight: torch.Tensor,  # [K, N / 8] int32
    qzeros: torch.Tensor,  # [K / g, N / 8] int32
    scales: torch.Tensor,  # [K / g, N]
    group_size: int,
) -> torch.Tensor:
    """AWQ GEMM: ``W[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]`` (product in the scales' dtype);
    returns ``[K, N]`` fp32."""
    q = ref_awq_unpack(qweight)  # [K, N]
    z = ref_awq_unpack(qzeros)  # [G, N]
    groups = torch.arange(q.shape[0], device=q.device) // group_size  # [K]
    # Dequantized in the scales' dtype (fp16 in checkpoints), as AutoAWQ / gptqmodel do.
    return ((q - z[groups]).to(scales.dtype) * scales[groups]).float()


def ref_gptq_dequant(
    qweight: torch.Tensor,  # [K * bits / 32, N] int32
    qzeros: torch.Tensor,  # [G, N * bits / 32] int32
    scales: torch.Tensor,  # [G, N]
    g_idx: torch.Tensor,  # [K] group of each input row
    bits: int,
    zero_offset: int = 1,
) -> torch.Tensor:
    """GPTQ: ``W[k, n] = (q[k, n] - (z[g_idx[k], n] + zero_offset)) * s[g_idx[k], n]``, ``[K, N]`` fp32.

    ``zero_offset`` is 1 for the original auto-gptq format (zeros stored minus one) and 0 for v2.
    """
    q = ref_gptq_unpack_rows(qweight, bits)  # [K, N]
    z = ref_gptq_unpack_cols(qzeros, bits) + zero_offset  # [G, N]
    g = g_idx.long()
    # Dequantized in the scales' dtype (fp16 in checkpoints), as gptqmodel does.
    return ((q - z[g]).to(scales.dtype) * scales[g]).float()


def ref_awq_gemm(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``x [M, K] @ W [K, N]`` with the AWQ-dequantized weight, fp32 math, result in ``x.dtype``."""
    return (x.float() @ ref_awq_dequant(qweight, qzeros, scales, group_size)).to(x.dtype)


def ref_gptq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    zero_offset: int = 1,
) -> torch.Tensor:
    """``x [M, K] @ W [K, N]`` with the GPTQ-dequantized weight, fp32 math, result in ``x.dtype``."""
    w = ref_gptq_dequant(qweight, qzeros, scales, g_idx, bits, zero_offset)
    return (x.float() @ w).to(x.dtype)


FP8_E4M3_MAX = 448.0


def ref_fp8_quant_dequant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Fake-quantize ``x`` to e4m3 with ``scale`` (broadcastable): ``fp8(clamp(x / s)) * s``, fp32."""
    q = torch.clamp(x.float() / scale.float(), -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.float() * scale.float()


def ref_fp8_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N, 1] (per channel) or [1] (per tensor)
    input_scale: torch.Tensor | None = None,  # static per-tensor scale; None = dynamic per token
    bias: torch.Tensor | None = None,
    quantize_input: bool = True,
) -> torch.Tensor:
    """W8A8 FP8 linear: the input is fake-quantized (static scale, or per token ``amax / 448``),
    the weight dequantized; ``y = x_dq @ (w * s_w).T (+ b)`` in fp32, returned in ``x.dtype``."""
    xf = x.float()
    if quantize_input:
        if input_scale is None:
            s = xf.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).eps) / FP8_E4M3_MAX
        else:
            s = input_scale.float().reshape(1, 1)
        xf = ref_fp8_quant_dequant(xf, s)
    w = weight.float() * weight_scale.float().reshape(-1, 1)
    y = xf @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Int8 W8A8 (CPU)
# ---------------------------------------------------------------------------------------------


def ref_int8_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] int8
    weight_scale: torch.Tensor,  # [N]
    bias: torch.Tensor | None = None,
    qmax: float = 127.0,
) -> torch.Tensor:
    """W8A8 int8 linear, row by row in float64: each row of ``x`` is quantized on its own
    (``s = amax|x| / qmax``, ``q = clamp(round(x / s), -128, 127)``), ``y = (q @ Wq.T) * s * s_w (+ b)``,
    in ``x.dtype``. ``qmax`` 127.5: compressed-tensors' scale. The quantization is float32 math, as
    the kernel's and compressed-tensors' are (a value on a rounding edge, a row's amax at -127.5
    among them, rounds the same way); the product float64."""
    w = weight.double()
    rows = []
    for row in x.float():
        s = row.abs().max().clamp(min=torch.finfo(torch.float32).tiny) / qmax  # float32
        q = torch.round(row / s).clamp(-128, 127)
        rows.append((w @ q.double()) * s.double() * weight_scale.double())
    y = torch.stack(rows) if rows else torch.zeros(0, weight.shape[0], dtype=torch.float64)
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def ref_int8_logits(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Logits against a per-row int8 table: ``(x @ q.T) * scale`` in float64, then ``x.dtype``;
    x [M, K], q [N, K] int8, scale [N] (``quant/embedding_int8.py``'s dequantized table times x)."""
    return ((x.double() @ q.double().T) * scale.double()).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Norm and activation
# ---------------------------------------------------------------------------------------------


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: fp32 statistics, cast back, then the weight in ``x``'s dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def ref_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def ref_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` over ``x [T, H, D]`` with ``cos``/``sin [T, D]``
    (the rotate-half form, full head width)."""
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]
