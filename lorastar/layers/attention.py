"""Attention over the paged KV cache: Triton kernels on GPU, plain torch on CPU.

CPU path: decode rows (one new token each) run as ONE batched SDPA over K/V gathered through
precomputed slot indices (built once per step, not per layer); prefill chunks run one SDPA
each (a step holds few of them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorastar.forward_context import ForwardContext
from lorastar.kernels.paged_attention import paged_attention, reshape_and_cache


def _read_blocks(cache: torch.Tensor, blocks: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``cache [NB, BS, Hkv, D]`` gathered at ``blocks [..., n]`` -> ``[..., n * BS, Hkv, D]``."""
    x = cache[blocks]  # [..., n, BS, Hkv, D]
    x = x.flatten(-4, -3)
    if x.dtype != dtype:  # FP8 cache: dequantize before SDPA (no fp8 SDPA on CPU)
        x = x.to(dtype)
        if scale != 1.0:
            x = x * scale
    return x


def attention_forward(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    ctx: ForwardContext,
    layer_idx: int,
    scale: float,
) -> torch.Tensor:
    md = ctx.attn
    k_cache, v_cache = ctx.kv_caches[layer_idx]
    ks = ctx.k_scales[layer_idx] if ctx.k_scales else 1.0
    vs = ctx.v_scales[layer_idx] if ctx.v_scales else 1.0
    reshape_and_cache(k, v, k_cache, v_cache, md.slot_mapping, ks, vs)
    if ctx.use_triton:
        return paged_attention(
            q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
            scale=scale, max_query_len=md.max_query_len, max_seq_len=md.max_seq_len,
            k_scale=ks, v_scale=vs,
        )  # fmt: skip

    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    if md.decode_rows is not None and md.decode_rows.numel() > 0:
        rows = md.decode_rows
        kd = _read_blocks(k_cache, md.decode_gather, ks, q.dtype)  # [Bd, nblk * BS, Hkv, D]
        vd = _read_blocks(v_cache, md.decode_gather, vs, q.dtype)
        qd = q[rows].unsqueeze(2)  # [Bd, Hq, 1, D]
        od = F.scaled_dot_product_attention(
            qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=md.decode_mask, scale=scale, enable_gqa=gqa
        )  # [Bd, Hq, 1, D]
        out[rows] = od.squeeze(2)
    for start, qlen, L, ctx_blocks in md.prefill_seqs:
        qs = q[start : start + qlen].transpose(0, 1)  # [Hq, q, D]
        if ctx_blocks is None:  # the whole sequence is in this chunk: K/V are the fresh tensors
            kk = k[start : start + qlen].transpose(0, 1)
            vv = v[start : start + qlen].transpose(0, 1)
            o = F.scaled_dot_product_attention(qs, kk, vv, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            kk = _read_blocks(k_cache, ctx_blocks, ks, q.dtype)[:L].transpose(0, 1)  # [Hkv, L, D]
            vv = _read_blocks(v_cache, ctx_blocks, vs, q.dtype)[:L].transpose(0, 1)
            # Row i sits at position L - q + i and sees keys 0..L - q + i.
            mask = torch.ones(qlen, L, dtype=torch.bool).tril(diagonal=L - qlen)
            o = F.scaled_dot_product_attention(qs, kk, vv, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start : start + qlen] = o.transpose(0, 1)
    return out
