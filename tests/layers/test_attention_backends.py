"""The attention backends agree through ``attention_forward``: the CPU one (TorchAttentionMetadata,
SDPA) and the CUDA one (plain AttentionMetadata, Triton paged attention; interpreted here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lorastar.forward_context import AttentionMetadata, ForwardContext
from lorastar.kernels import cpu_native
from lorastar.kernels.reference import ref_paged_attention
from lorastar.layers.attention import TorchAttentionMetadata, attention_forward, build_attention_metadata


def padded_block_tables(tables: list[list[int]], fill: int = 0) -> torch.Tensor:
    """``[B, max_len]`` int32 block tables, short rows padded with ``fill`` (the tests' reference
    form of what the input batch keeps in its persistent rows)."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [fill] * (width - len(t)) for t in tables], dtype=torch.int32)


BS, HQ, HKV, D = 4, 4, 2, 16


def paged_layout(seqs: list[tuple[int, int]]) -> tuple[list[list[int]], list[int], list[int], list[int], int]:
    """Blocks laid out in order for ``(context already cached, new tokens)`` per sequence: (block
    tables, the new tokens' cache slots, query lengths, context lengths after the step, blocks used)."""
    tables: list[list[int]] = []
    slots: list[int] = []
    nxt = 0
    for ctx, q in seqs:
        n = -(-(ctx + q) // BS)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
        slots += [tables[-1][p // BS] * BS + p % BS for p in range(ctx, ctx + q)]
    return tables, slots, [q for _, q in seqs], [c + q for c, q in seqs], nxt


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_torch_and_triton_backends_agree(kv_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    # (context already cached, new tokens): chunked prefill, decode, fresh prefill, decode (a fresh
    # prefill over an FP8 cache attends over the values the cache holds, as the Triton path does).
    seqs = [(4, 3), (4, 1), (0, 5), (9, 1)]
    tables, slots, q_lens, seq_lens, nxt = paged_layout(seqs)
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


@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (3, 0.0), (6, 0.0), (0, 2.0), (5, 2.0)])
def test_windows_and_softcap_match_reference(window: int, softcap: float) -> None:
    """Both backends against the plain reference, with sliding windows (block-table entries wholly
    before every row's window set to -1, as the block manager frees them) and logit soft-capping."""
    gen = torch.Generator().manual_seed(1)
    # (context already cached, new tokens): decodes and chunks several windows long.
    seqs = [(13, 1), (0, 11), (9, 6), (2, 1), (17, 3), (0, 1)]
    tables, slots, q_lens, seq_lens, nxt = paged_layout(seqs)
    t = sum(q_lens)
    q, k, v = (torch.randn(t, h, D, generator=gen) * 3 for h in (HQ, HKV, HKV))
    cache = torch.randn(nxt, BS, HKV, D, generator=gen)
    freed = [list(tb) for tb in tables]
    if window:
        for tb, (ctx, _) in zip(freed, seqs):
            for i in range(max(0, ctx - window + 1) // BS):
                tb[i] = -1
    md = build_attention_metadata(
        slots, q_lens, seq_lens, padded_block_tables(freed), block_size=BS, device=torch.device("cpu")
    )
    common = {f.name: getattr(md, f.name) for f in dataclasses.fields(AttentionMetadata)}
    backends: list[AttentionMetadata] = [md, AttentionMetadata(**common)]
    if cpu_native.load() is not None:  # the C++ decode op (tests/kernels/test_cpu_native.py)
        backends.append(dataclasses.replace(md, native_decode=True, plans={}))
    outs = []
    for attn in backends:
        caches = [(cache.clone(), cache.clone())]
        ctx = ForwardContext(attn=attn, kv_caches=caches)
        outs.append(attention_forward(q, k, v, ctx, 0, D**-0.5, sliding_window=window, softcap=softcap))
    k_cache, v_cache = cache.clone(), cache.clone()
    from lorastar.kernels.paged_attention import reshape_and_cache

    reshape_and_cache(k, v, k_cache, v_cache, md.slot_mapping)
    ref = ref_paged_attention(
        q, k_cache, v_cache, padded_block_tables(tables), md.seq_lens, md.query_start_loc,
        scale=D**-0.5, sliding_window=window, softcap=softcap,
    )  # fmt: skip
    for got in outs:
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)
    if window:  # the window matters for these sequences
        full = ref_paged_attention(
            q, k_cache, v_cache, padded_block_tables(tables), md.seq_lens, md.query_start_loc, scale=D**-0.5
        )
        assert not torch.allclose(full, ref, atol=1e-3)


@pytest.mark.parametrize("window", [0, 5])
def test_cpu_prefill_chunks_run_the_fused_sdpa_kernel(window: int) -> None:
    """Prefill chunks (a whole prompt, and a chunk after cached context with its mask) run torch's
    fused CPU attention, never the math fallback that 3-D inputs got (3-4x slower on 256-1024-token
    prompts): the profiler names the kernel each SDPA call dispatched to."""
    from torch.profiler import profile

    gen = torch.Generator().manual_seed(2)
    seqs = [(0, 9), (6, 7)]  # (context already cached, new tokens)
    tables, slots, q_lens, seq_lens, nxt = paged_layout(seqs)
    md = build_attention_metadata(
        slots, q_lens, seq_lens, padded_block_tables(tables), block_size=BS, device=torch.device("cpu")
    )
    t = sum(q_lens)
    q, k, v = (torch.randn(t, h, D, generator=gen) for h in (HQ, HKV, HKV))
    caches = [(torch.randn(nxt, BS, HKV, D, generator=gen), torch.randn(nxt, BS, HKV, D, generator=gen))]
    ctx = ForwardContext(attn=md, kv_caches=caches)
    with profile() as prof:
        out = attention_forward(q, k, v, ctx, 0, D**-0.5, sliding_window=window)
    names = [e.key for e in prof.key_averages()]
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention") == 2
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    assert "aten::_scaled_dot_product_attention_math" not in names
    ref = ref_paged_attention(
        q, caches[0][0], caches[0][1], padded_block_tables(tables), torch.tensor(seq_lens),
        torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]), scale=D**-0.5, sliding_window=window,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
