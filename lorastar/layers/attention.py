"""Attention over the paged KV cache, one backend per device, each with its own metadata.

* Triton (CUDA): ``kernels/paged_attention.py`` reads the common ``AttentionMetadata`` directly.
* Torch (CPU): ``TorchAttentionMetadata`` adds what SDPA needs, precomputed once per step and window
  size (not per layer): decode rows (one new token each) run as ONE C++ op reading K/V straight
  from the blocks (fp32 / bf16, ``kernels/cpu_native.py``) or as ONE batched SDPA over K/V gathered
  block-wise; prefill chunks run one SDPA each (a step holds few of them; a chunk after cached
  context gathers its own blocks once).

Both take a per-layer ``sliding_window`` (keys a row sees; 0 = all) and ``softcap`` (Gemma 2's
attention-logit soft-capping) and never read block-table entries before every row's window.

``build_attention_metadata`` picks the backend from the device; ``attention_forward`` runs the
backend whose metadata it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from lorastar.forward_context import AttentionMetadata, ForwardContext, to_device
from lorastar.kernels.cpu_native import DTYPES as CPU_NATIVE_DTYPES
from lorastar.kernels.cpu_native import paged_decode as cpu_paged_decode
from lorastar.kernels.paged_attention import _to_cache_dtype, paged_attention, reshape_and_cache


@dataclass
class TorchPlan:
    """The CPU backend's gather plan for one window size (0: full causal), built once per step.

    Decode rows (q == 1) gather, per row, the blocks from the one holding its first visible key to
    its last, as one rectangular ``[Bd, nblk]`` index (short rows padded and masked), and run as ONE
    batched SDPA. Prefill chunks run one SDPA each over their visible blocks. Blocks before every
    row's window are never gathered (the block manager may have freed them: ``-1`` entries)."""

    block_size: int = 16
    decode_rows: torch.Tensor | None = None  # [Bd] int64 row index in the flat batch
    decode_gather: torch.Tensor | None = None  # [Bd, nblk] int64 block ids
    decode_lo: torch.Tensor | None = None  # [Bd] int64 first key position seen (the native op's form)
    decode_lens: torch.Tensor | None = None  # [Bd] int64 context length
    # The SDPA path's mask, made on its first use in a step (the native op needs none):
    # [Bd, 1, 1, nblk * block_size] bool, True = attend.
    decode_mask: torch.Tensor | None = None
    # The same mask as 0 / -inf in the query dtype, made once per step: SDPA converts a bool mask on
    # every call (30 layers), and the additive form runs 184 vs 211 us (20 rows of SmolLM2).
    decode_bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def mask(self) -> torch.Tensor:
        """The decode rows' bool mask over their gathered key positions, made once."""
        if self.decode_mask is None:
            assert self.decode_gather is not None and self.decode_lo is not None
            assert self.decode_lens is not None
            lo, lens, bs = self.decode_lo, self.decode_lens, self.block_size
            p = (lo // bs)[:, None] * bs + torch.arange(self.decode_gather.shape[1] * bs)[None, :]
            self.decode_mask = ((p < lens[:, None]) & (p >= lo[:, None]))[:, None, None, :]
        return self.decode_mask

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        got = self.decode_bias.get(dtype)
        if got is None:
            mask = self.mask()
            got = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
            self.decode_bias[dtype] = got
        return got

    # (row_start, q, context length, first key position read, its blocks or None when the chunk is
    # the whole sequence so far and K/V come straight from this step's tensors).
    prefill_seqs: list[tuple[int, int, int, int, torch.Tensor | None]] = field(default_factory=list)


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """The CPU backend's metadata: the common fields (host tensors here) plus per-window plans."""

    # Decode rows of fp32 / bf16 layers read the cache with the C++ op (kernels/cpu_native.py) instead
    # of gather + SDPA: 20 SmolLM2 rows over ~175 cold keys 461 vs 1265 us a layer; whole decode
    # steps at c=20 1.1x tok/s (attention 344 vs 453 us a layer, the rest unchanged).
    native_decode: bool = False
    plans: dict[int, TorchPlan] = field(default_factory=dict)

    def plan(self, window: int) -> TorchPlan:
        """The gather plan for layers with ``window`` (0: full attention), made on first use."""
        got = self.plans.get(window)
        if got is None:
            got = self.plans[window] = _build_plan(self, window)
        return got


def _build_plan(md: TorchAttentionMetadata, window: int) -> TorchPlan:
    bs = md.block_size
    tables = md.block_tables  # [B, max_blocks] int32, host
    plan = TorchPlan(block_size=bs)
    qsl = md.query_start_loc.numpy().astype(np.int64)  # [B + 1] (host tensors on this backend)
    seq_lens = md.seq_lens.numpy().astype(np.int64)  # [B]
    qlens = qsl[1:] - qsl[:-1]  # [B]
    is_dec = qlens == 1
    dec = np.flatnonzero(is_dec)
    if dec.size:
        # In numpy, and the SDPA path's mask only when it runs: as a dozen tiny torch ops this plan
        # took 0.14-0.16 ms per step at one sequence (host_overhead's 1-layer model), now 0.06-0.10.
        lens = seq_lens[dec]  # [Bd] int64
        lo = np.maximum(lens - window, 0) if window > 0 else np.zeros_like(lens)  # first key seen
        first = lo // bs  # [Bd] first block read
        nblk = int(((lens + bs - 1) // bs - first).max())
        idx = np.minimum(first[:, None] + np.arange(nblk), tables.shape[1] - 1)  # [Bd, nblk]
        # Whole blocks: one contiguous [BS, Hkv, D] row per gathered index (holes/padding masked).
        gather = tables.numpy()[dec[:, None], idx].astype(np.int64)  # [Bd, nblk]
        plan.decode_gather = torch.from_numpy(np.maximum(gather, 0, out=gather))
        plan.decode_rows = torch.from_numpy(qsl[dec])  # [Bd] int64
        plan.decode_lo, plan.decode_lens = torch.from_numpy(lo), torch.from_numpy(lens)
    for i in np.flatnonzero(~is_dec).tolist():
        row0, q, L = int(qsl[i]), int(qlens[i]), int(seq_lens[i])
        if L == q:  # the whole sequence is in this chunk: K/V are the fresh tensors
            plan.prefill_seqs.append((row0, q, L, 0, None))
            continue
        # Earlier chunks or a cached prefix: read the visible context blocks from the cache.
        lo_i = max(0, L - q - window + 1) if window > 0 else 0
        first_i = lo_i // bs
        blocks = tables[i, first_i : -(-L // bs)].long().clamp(min=0)
        plan.prefill_seqs.append((row0, q, L, first_i * bs, blocks))
    return plan


def build_attention_metadata(
    slot_mapping: list[int] | torch.Tensor,  # [num_tokens]
    query_lens: Sequence[int] | np.ndarray,  # [B]
    seq_lens: Sequence[int] | np.ndarray,  # [B]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, host
    *,
    block_size: int,
    device: torch.device,
    native_cpu_decode: bool = False,
) -> AttentionMetadata:
    """One step's metadata for the backend of ``device``: sequence ``b`` has ``query_lens[b]`` new
    tokens (flat rows in order) and ``seq_lens[b]`` tokens of context after this step.
    ``native_cpu_decode``: CPU decode rows use ``kernels/cpu_native.py`` (the caller loaded it)."""
    q = np.asarray(query_lens, dtype=np.int64)  # [B]
    lens = np.asarray(seq_lens, dtype=np.int64)  # [B]
    qsl = np.zeros(len(q) + 1, dtype=np.int64)  # [B + 1]
    np.cumsum(q, out=qsl[1:])
    common = {
        "slot_mapping": to_device(slot_mapping, device, torch.int64),
        "query_start_loc": to_device(qsl.astype(np.int32), device),
        "seq_lens": to_device(lens.astype(np.int32), device),
        "block_tables": to_device(block_tables, device),
        "max_query_len": int(q.max()),
        "max_seq_len": int(lens.max()),
        "block_size": block_size,
    }
    if device.type == "cuda":
        return AttentionMetadata(**common)
    return TorchAttentionMetadata(
        **common,
        native_decode=native_cpu_decode,
    )


def _read_blocks(cache: torch.Tensor, blocks: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``cache [NB, BS, Hkv, D]`` gathered at ``blocks [..., n]`` -> ``[..., n * BS, Hkv, D]``.
    ``index_select`` copies whole blocks: 3.3x faster than ``cache[blocks]`` here (20 sequences x
    12 blocks of SmolLM2's K: 35 vs 115 us), and this runs twice per layer and step."""
    x = cache.index_select(0, blocks.reshape(-1)).view(
        *blocks.shape, *cache.shape[1:]
    )  # [..., n, BS, Hkv, D]
    x = x.flatten(-4, -3)
    return _dequantize(x, scale, dtype) if x.dtype != dtype else x  # FP8 cache (no fp8 SDPA on CPU)


def _dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    x = x.to(dtype)
    return x * scale if scale != 1.0 else x


def _fp8_round_trip(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as ``_read_blocks`` gives it back once ``reshape_and_cache`` has stored it."""
    return _dequantize(_to_cache_dtype(x, cache_dtype, scale), scale, x.dtype)


def _sdpa(
    q: torch.Tensor,  # [..., Hq, q, D]
    k: torch.Tensor,  # [..., Hkv, L, D]
    v: torch.Tensor,
    mask: torch.Tensor
    | None,  # broadcastable to [..., Hq, q, L]: bool (True = attend) or additive; None: causal
    scale: float,
    softcap: float,
) -> torch.Tensor:
    gqa = q.shape[-3] != k.shape[-3]
    if softcap <= 0:
        # Torch's fused CPU kernel (flash attention, GQA and masks included) takes only 4-D inputs;
        # 3-D ones fall back to the math path, which materializes the scores and repeats K/V per
        # group: a 256-token SmolLM2 prefill 1.35 vs 5.3 ms a layer, 2 threads.
        unbatched = q.dim() == 3
        if unbatched:
            q, k, v = q[None], k[None], v[None]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
        )
        return o[0] if unbatched else o
    # Soft-capped logits (Gemma 2): SDPA has no hook between the scores and the softmax.
    if gqa:
        g = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [..., Hq, q, L]
    s = softcap * torch.tanh(s / softcap)
    if mask is None:
        mask = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril()
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v)


def attention_forward(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    ctx: ForwardContext,
    layer_idx: int,
    scale: float,
    *,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Write this step's K/V into layer ``layer_idx``'s cache and attend (``sliding_window`` w > 0:
    a row at position p sees keys p - w + 1..p; ``softcap`` c > 0: scores -> c * tanh(s / c))."""
    md = ctx.attn
    k_cache, v_cache = ctx.kv_caches[layer_idx]
    ks = ctx.k_scales[layer_idx] if ctx.k_scales else 1.0
    vs = ctx.v_scales[layer_idx] if ctx.v_scales else 1.0
    reshape_and_cache(k, v, k_cache, v_cache, md.slot_mapping, ks, vs)
    if not isinstance(md, TorchAttentionMetadata):
        return paged_attention(
            q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
            scale=scale, max_query_len=md.max_query_len, max_seq_len=md.max_seq_len,
            k_scale=ks, v_scale=vs, sliding_window=sliding_window, softcap=softcap,
        )  # fmt: skip

    plan = md.plan(sliding_window)
    out = torch.empty_like(q)
    rows = None
    if plan.decode_rows is not None and plan.decode_rows.numel() > 0:
        rows = plan.decode_rows
        if md.native_decode and q.dtype == k_cache.dtype in CPU_NATIVE_DTYPES and q.stride(1) == q.shape[2]:
            assert plan.decode_gather is not None and plan.decode_lo is not None
            assert plan.decode_lens is not None
            cpu_paged_decode(
                q, k_cache, v_cache, rows, plan.decode_gather, plan.decode_lo, plan.decode_lens, out,
                scale=scale, softcap=softcap,
            )  # fmt: skip
            rows = None
    if rows is not None:
        kd = _read_blocks(k_cache, plan.decode_gather, ks, q.dtype)  # [Bd, nblk * BS, Hkv, D]
        vd = _read_blocks(v_cache, plan.decode_gather, vs, q.dtype)
        qd = q[rows].unsqueeze(2)  # [Bd, Hq, 1, D]
        mask = plan.mask() if softcap > 0 else plan.bias(q.dtype)  # the softcap path takes bool
        od = _sdpa(qd, kd.transpose(1, 2), vd.transpose(1, 2), mask, scale, softcap)
        out[rows] = od.squeeze(2)  # [Bd, Hq, D]
    for start, qlen, L, k0, ctx_blocks in plan.prefill_seqs:
        qs = q[start : start + qlen].transpose(0, 1)  # [Hq, q, D]
        if ctx_blocks is None:  # the whole sequence is in this chunk: K/V are the fresh tensors
            kk = k[start : start + qlen].transpose(0, 1)
            vv = v[start : start + qlen].transpose(0, 1)
            # FP8 cache: attend over the values it holds, as a chunk after cached context, later
            # steps and the Triton path do (vLLM reads the cache): else the schedule changes outputs.
            if k_cache.dtype != q.dtype:
                kk = _fp8_round_trip(kk, k_cache.dtype, ks)
                vv = _fp8_round_trip(vv, v_cache.dtype, vs)
            mask = None
            if sliding_window > 0:
                mask = torch.ones(qlen, qlen, dtype=torch.bool).tril().triu(-(sliding_window - 1))
        else:
            kk = _read_blocks(k_cache, ctx_blocks, ks, q.dtype)[: L - k0].transpose(0, 1)  # [Hkv, L - k0, D]
            vv = _read_blocks(v_cache, ctx_blocks, vs, q.dtype)[: L - k0].transpose(0, 1)
            # Row i sits at position L - q + i and sees keys k0 + j for j <= L - q + i - k0
            # (and, with a window, k0 + j > L - q + i - w).
            mask = torch.ones(qlen, L - k0, dtype=torch.bool).tril(diagonal=L - qlen - k0)
            if sliding_window > 0:
                mask = mask.triu(diagonal=L - qlen - k0 - sliding_window + 1)
        o = _sdpa(qs, kk, vv, mask, scale, softcap)
        out[start : start + qlen] = o.transpose(0, 1)
    return out
