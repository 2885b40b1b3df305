"""The two attention backends agree through ``attention_forward``: the CPU one (TorchAttentionMetadata,
SDPA) and the CUDA one (plain AttentionMetadata, Triton paged attention; interpreted here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lorastar.forward_context import AttentionMetadata, ForwardContext, padded_block_tables
from lorastar.layers.attention import TorchAttentionMetadata, attention_forward, build_attention_metadata

BS, HQ, HKV, D = 4, 4, 2, 16


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_torch_and_triton_backends_agree(kv_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    # (context already cached, new tokens): chunked prefill, decode, fresh prefill, decode. A fresh
    # prefill on CPU attends over this step's unquantized K/V, not the FP8 cache: left out for FP8.
    seqs = [(4, 3), (4, 1), (0, 5), (9, 1)] if kv_dtype == torch.float32 else [(4, 3), (4, 1), (9, 1)]
    tables, slots, q_lens, seq_lens, nxt = [], [], [], [], 0
    for ctx, q in seqs:
        n = -(-(ctx + q) // BS)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
        slots += [tables[-1][p // BS] * BS + p % BS for p in range(ctx, ctx + q)]
        q_lens.append(q)
        seq_lens.append(ctx + q)
    md = build_attention_metadata(
        slots, q_lens, seq_lens, padded_block_tables(tables), block_size=BS, device=torch.device("cpu")
    )
    assert isinstance(md, TorchAttentionMetadata)
    common = {f.name: getattr(md, f.name) for f in dataclasses.fields(AttentionMetadata)}
    gpu_md = AttentionMetadata(**common)  # what the CUDA backend is given
    t = sum(q_lens)
    q, k, v = (torch.randn(t, h, D, generator=gen) for h in (HQ, HKV, HKV))
    cache = torch.randn(nxt, BS, HKV, D, generator=gen).to(kv_dtype)
    outs = []
    for attn in (md, gpu_md):
        caches = [(cache.clone(), cache.clone())]
        ctx = ForwardContext(attn=attn, kv_caches=caches, k_scales=[0.5], v_scales=[0.25])
        outs.append(attention_forward(q, k, v, ctx, 0, D**-0.5))
    tol = 2e-4 if kv_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)
