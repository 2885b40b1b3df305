"""Int4/int8 weight-only GEMM (AWQ and GPTQ layouts) that dequantizes inside the GEMM.

``y [M, N] = x [M, K] @ W [K, N]`` where ``W`` never exists in full precision: each program loads
a ``[BLOCK_K, BLOCK_N]`` tile of packed int32 words, unpacks it, applies the group's zero point and
scale in registers and feeds the tile straight to ``tl.dot`` (fp32 accumulation).

The product ``(q - z) * s`` is taken in the scales' dtype (fp16 in checkpoints), as AutoAWQ and
gptqmodel dequantize; the tile then goes to ``tl.dot`` in the activation dtype (fp32: exact IEEE dot).

Layouts (see ``kernels/reference.py`` for the plain-torch oracles):
  AWQ   qweight ``[K, N/8]`` int32, 8 columns per word in AWQ's interleaved order,
        qzeros ``[K/g, N/8]`` (same packing), scales ``[K/g, N]``; ``W = (q - z) * s``.
  GPTQ  qweight ``[K*bits/32, N]`` (rows packed sequentially), qzeros ``[G, N*bits/32]``
        (columns packed sequentially), scales ``[G, N]``, optional ``g_idx [K]`` (act-order);
        ``W = (q - (z + zero_offset)) * s`` with ``zero_offset`` 1 for the original format.

Tested on CPU under ``TRITON_INTERPRET=1`` (fp32/fp16 only: the interpreter's bf16 is broken).
"""

from __future__ import annotations

import torch

from lorastar.kernels._triton import num_sms, tl, triton

AWQ = 0
GPTQ = 1


@triton.jit
def _expand8(w):
    """``[..., C]`` -> ``[..., 8C]``: every word repeated 8 times in a row (one copy per column)."""
    w = tl.interleave(w, w)
    w = tl.interleave(w, w)
    return tl.interleave(w, w)


@triton.jit
def _quant_gemm_kernel(
    x_ptr,
    qw_ptr,
    qz_ptr,
    s_ptr,
    gidx_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_qk,
    stride_qn,
    stride_zg,
    stride_zn,
    stride_sg,
    stride_sn,
    stride_om,
    stride_on,
    group_size,
    zero_offset,
    FORMAT: tl.constexpr,  # 0 = AWQ, 1 = GPTQ
    BITS: tl.constexpr,
    HAS_GIDX: tl.constexpr,  # GPTQ act-order: group of each input row read from g_idx
    GROUP_TILE: tl.constexpr,  # every K tile lies inside one group: load one scale row per tile
    IEEE: tl.constexpr,  # fp32 inputs: exact fp32 dot (no tf32), so results match the references
    SPLIT_K: tl.constexpr,  # >1: programs split K and atomically add fp32 partial sums
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    m_mask = offs_m < M
    n_mask = offs_n < N
    PER: tl.constexpr = 32 // BITS  # values per int32 word
    MASK: tl.constexpr = (1 << BITS) - 1
    if FORMAT == 0:
        # Load each packed word once ([.., BN/8], contiguous) and expand it to its 8 columns.
        # AWQ order [0, 2, 4, 6, 1, 3, 5, 7]: column j of a word sits in nibble (j % 2) * 4 + j // 2.
        offs_w = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)  # [BN/8] word columns
        w_mask = offs_w < N // 8
        j = tl.arange(0, BLOCK_N) % 8
        col_shift = ((j % 2) * 4 + j // 2) * 4  # [BN]
    else:
        col_shift = (offs_n % PER) * BITS  # zeros are packed along N for GPTQ
        col_word = offs_n // PER
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BM, BK]
        if FORMAT == 0:
            qp = tl.load(
                qw_ptr + offs_k[:, None] * stride_qk + offs_w[None, :] * stride_qn,
                mask=k_mask[:, None] & w_mask[None, :],
                other=0,
            )  # [BK, BN/8]
            q = (_expand8(qp) >> col_shift[None, :]) & MASK  # [BK, BN]
        else:
            q = tl.load(
                qw_ptr + (offs_k[:, None] // PER) * stride_qk + offs_n[None, :] * stride_qn,
                mask=k_mask[:, None] & n_mask[None, :],
                other=0,
            )
            q = (q >> ((offs_k[:, None] % PER) * BITS)) & MASK  # [BK, BN]
        if GROUP_TILE:
            g = k0 // group_size
            if FORMAT == 0:
                zp = tl.load(qz_ptr + g * stride_zg + offs_w * stride_zn, mask=w_mask, other=0)  # [BN/8]
                z = (_expand8(zp) >> col_shift) & MASK  # [BN]
            else:
                z = tl.load(qz_ptr + g * stride_zg + col_word * stride_zn, mask=n_mask, other=0)  # [BN]
                z = ((z >> col_shift) & MASK) + zero_offset
            s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0)
            # Dequantize in the scales' dtype (fp16 in checkpoints), like AutoAWQ / gptqmodel.
            w = (q - z[None, :]).to(s.dtype) * s[None, :]  # [BK, BN]
        else:
            if HAS_GIDX:
                g = tl.load(gidx_ptr + offs_k, mask=k_mask, other=0)  # [BK]
            else:
                g = offs_k // group_size
            if FORMAT == 0:
                zp = tl.load(
                    qz_ptr + g[:, None] * stride_zg + offs_w[None, :] * stride_zn,
                    mask=k_mask[:, None] & w_mask[None, :],
                    other=0,
                )
                z = (_expand8(zp) >> col_shift[None, :]) & MASK  # [BK, BN]
            else:
                z = tl.load(
                    qz_ptr + g[:, None] * stride_zg + col_word[None, :] * stride_zn,
                    mask=k_mask[:, None] & n_mask[None, :],
                    other=0,
                )
                z = ((z >> col_shift[None, :]) & MASK) + zero_offset  # [BK, BN]
            s = tl.load(
                s_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn,
                mask=k_mask[:, None] & n_mask[None, :],
                other=0.0,
            )
            w = (q - z).to(s.dtype) * s  # [BK, BN]
        if IEEE:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_mask)  # fp32 buffer, cast by the wrapper


def _blocks(m: int, group_size: int, k: int) -> tuple[int, int, int]:
    # tl.dot needs every dim >= 16 on NVIDIA; small M (decode) gets a narrow M tile.
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64
    block_k = 64 if group_size % 64 == 0 else 32
    if k < block_k:
        block_k = max(16, triton.next_power_of_2(k))
    return block_m, block_n, block_k


def _launch(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    *,
    fmt: int,
    bits: int,
    group_size: int,
    n: int,
    zero_offset: int,
    split_k: int | None = None,
) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"quant_gemm expects x [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk = _blocks(m, group_size, k)
    group_tile = g_idx is None and group_size % bk == 0 and k % bk == 0
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if split_k is None:
        # Decode-sized GEMMs have too few (M, N) tiles to fill the GPU: split K across programs.
        split_k = 1
        if x.is_cuda and m <= 64:
            split_k = max(1, min(16, (2 * num_sms(x.device)) // tiles, k // (4 * bk)))
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split_k)
    if split_k > 1:
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _quant_gemm_kernel[grid](
        x,
        qweight,
        qzeros,
        scales,
        g_idx if g_idx is not None else qweight,  # dummy pointer when unused
        out,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        qzeros.stride(0),
        qzeros.stride(1),
        scales.stride(0),
        scales.stride(1),
        out.stride(0),
        out.stride(1),
        group_size,
        zero_offset,
        FORMAT=fmt,
        BITS=bits,
        HAS_GIDX=g_idx is not None,
        GROUP_TILE=group_tile,
        IEEE=x.dtype == torch.float32,
        SPLIT_K=split_k,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
    )
    return out if out.dtype == x.dtype else out.to(x.dtype)


def awq_gemm(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K, N/8] int32
    qzeros: torch.Tensor,  # [K/g, N/8] int32
    scales: torch.Tensor,  # [K/g, N]
    group_size: int,
    split_k: int | None = None,
) -> torch.Tensor:
    """``x @ W`` for an AutoAWQ GEMM-format weight; returns ``[M, N]`` in ``x.dtype``.

    ``split_k``: programs along K (``None``: chosen from the GPU's SM count for small M)."""
    return _launch(
        x,
        qweight,
        qzeros,
        scales,
        None,
        fmt=AWQ,
        bits=4,
        group_size=group_size,
        n=scales.shape[1],
        zero_offset=0,
        split_k=split_k,
    )


def gptq_gemm(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K*bits/32, N] int32
    qzeros: torch.Tensor,  # [G, N*bits/32] int32
    scales: torch.Tensor,  # [G, N]
    g_idx: torch.Tensor | None,  # [K] int32 (act-order) or None (group = k // group_size)
    bits: int,
    group_size: int,
    zero_offset: int = 1,
    split_k: int | None = None,
) -> torch.Tensor:
    """``x @ W`` for a GPTQ-format weight; returns ``[M, N]`` in ``x.dtype``."""
    if bits not in (4, 8):
        raise ValueError(f"gptq_gemm supports 4 and 8 bits, got {bits}")
    return _launch(
        x,
        qweight,
        qzeros,
        scales,
        g_idx,
        fmt=GPTQ,
        bits=bits,
        group_size=group_size,
        n=scales.shape[1],
        zero_offset=zero_offset,
        split_k=split_k,
    )
