"""Attention over the paged KV cache, one backend per device, each with its own metadata.

* Triton (CUDA): ``kernels/paged_attention.py`` reads the common ``AttentionMetadata`` directly.
* Torch (CPU): ``TorchAttentionMetadata`` adds what SDPA needs, precomputed once per step (not per
  layer): decode rows (one new token each) run as ONE batched SDPA over K/V gathered block-wise;
  prefill chunks run one SDPA each (a step holds few of them).

``build_attention_metadata`` picks the backend from the device; ``attention_forward`` runs the
backend whose metadata it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lorastar.forward_context import AttentionMetadata, ForwardContext
from lorastar.kernels.paged_attention import paged_attention, reshape_and_cache


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """The CPU backend's metadata: the common fields plus the per-step gather plan."""

    # Decode rows (q == 1): the blocks to gather and a padding mask over their slots.
    decode_rows: torch.Tensor | None = None  # [Bd] int64 row index in the flat batch
    decode_gather: torch.Tensor | None = None  # [Bd, nblk] int64 block ids
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, nblk * block_size] bool, True = attend
    # Prefill rows: (row_start, q, context length, context block ids or None when the chunk is the
    # whole sequence so far and K/V come straight from this step's tensors).
    prefill_seqs: list[tuple[int, int, int, torch.Tensor | None]] = field(default_factory=list)


def build_attention_metadata(
    slot_mapping: list[int],
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,  # [B, max_blocks] int32, host
    *,
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """One step's metadata for the backend of ``device``: sequence ``b`` has ``query_lens[b]`` new
    tokens (flat rows in order) and ``seq_lens[b]`` tokens of context after this step."""
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    common = {
        "slot_mapping": torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        "query_start_loc": torch.tensor(qsl, dtype=torch.int32, device=device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "block_tables": block_tables.to(device),
        "max_query_len": max(query_lens),
        "max_seq_len": max(seq_lens),
        "block_size": block_size,
    }
    if device.type == "cuda":
        return AttentionMetadata(**common)
    md = TorchAttentionMetadata(**common)
    dec = [i for i, q in enumerate(query_lens) if q == 1]
    if dec:
        lens = torch.tensor([seq_lens[i] for i in dec])
        nblk = -(-int(lens.max()) // block_size)
        md.decode_rows = torch.tensor([qsl[i] for i in dec], dtype=torch.int64)
        # Whole blocks: one contiguous [BS, Hkv, D] row per gathered index.
        md.decode_gather = block_tables[dec, :nblk].long()  # [Bd, nblk]
        p = torch.arange(nblk * block_size)
        md.decode_mask = (p[None, :] < lens[:, None])[:, None, None, :]  # [Bd, 1, 1, nblk * BS]
    for i, (q, L) in enumerate(zip(query_lens, seq_lens)):
        if q == 1:
            continue
        ctx_blocks = None
        if L != q:  # earlier chunks or cached prefix: read the context blocks from the cache
            ctx_blocks = block_tables[i, : -(-L // block_size)].long()
        md.prefill_seqs.append((qsl[i], q, L, ctx_blocks))
    return md


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
    if not isinstance(md, TorchAttentionMetadata):
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
