"""CUDA-graph decode steps: same tokens as eager steps and as PEFT, through padding, hot loads
and slice-layout changes; graphs really replay (a silent fallback to eager would fail here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorastar import LLM, SamplingParams
from lorastar.engine.cuda_graphs import capture_sizes


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(256)[-1] == 256


def _graphs_used(llm: LLM) -> set[tuple[int, bool]]:
    graphs = llm.engine.runner.graphs
    assert graphs is not None and not graphs.disabled
    return set(graphs.graphs)


def _greedy(llm: LLM, prompts: list[list[int]], adapters: list[str | None] | None = None) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, adapter=adapters)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2"])
def test_graphs_match_eager_across_batch_sizes(tiny_model_dir, name: str) -> None:
    path = tiny_model_dir(name)
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=32)
    eager = LLM(path, enforce_eager=True, **kw)
    graphed = LLM(path, **kw)
    assert eager.engine.runner.graphs is None
    for batch in (1, 3, 9, 17, 5):  # padded to 1, 4, 16, 24, 8; 5 after 17 reuses stale rows
        prompts = [[3 + i] * (2 + 7 * i) for i in range(batch)]
        assert _greedy(graphed, prompts) == _greedy(eager, prompts), f"batch {batch}"
    assert {n for n, _ in _graphs_used(graphed)} == {1, 4, 8, 16, 24}
    graphed.engine.check_invariants()
    assert graphed.kv_cache_usage()["num_used_blocks"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("compact", [False, True], ids=["plain-grid", "compact-grid"])
def test_graphs_with_lora_match_peft_through_hot_loads(
    tiny_model_dir, tmp_path: Path, compact: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compact``: the expand on its compact grid (``kernels/lora.py`` ``EXPAND_COMPACT_GRID``)."""
    import lorastar.kernels.lora as lora_kernels
    from tests.adapters.test_lora_vs_peft import make_adapters, peft_greedy, peft_reference

    monkeypatch.setattr(lora_kernels, "EXPAND_COMPACT_GRID", compact)

    base_dir = tiny_model_dir("llama-gqa")
    paths = make_adapters(base_dir, tmp_path)
    ref = peft_reference(base_dir, paths)
    llm = LLM(base_dir, device="cuda", dtype="float32", num_kv_blocks=256, max_loras=4, max_lora_rank=16)
    prompts = [[7 + i] * (5 + 3 * i) for i in range(6)]
    # every slot set stacks its A under the base weight: decode steps take the shrink in the base GEMM
    assert all(lora.stacked is not None for _, lora in llm.engine.lora_state.slots)

    # One adapter first: graphs are captured with only its slice buffers allocated.
    llm.load_adapter("a", paths["a"])
    order: list[str | None] = ["a", None, "a", None, "a", "a"]
    got = _greedy(llm, prompts, order)
    assert got == [peft_greedy(ref, p, a, 12) for p, a in zip(prompts, order)]
    assert any(lora for _, lora in _graphs_used(llm))
    version = llm.engine.lora_state.layout_version

    # Hot-load the rest: new target modules -> new slice buffers -> LoRA graphs recaptured.
    for n in ("b", "c", "d"):
        llm.load_adapter(n, paths[n])
    order = ["a", "b", None, "c", "d", "b"]
    got = _greedy(llm, prompts, order)
    assert got == [peft_greedy(ref, p, a, 12) for p, a in zip(prompts, order)]
    assert llm.engine.lora_state.layout_version > version  # slots are filled when first scheduled

    # Same name, new weights, same slot layout: replays read the new weights.
    llm.unload_adapter("a")
    llm.load_adapter("a", paths["c"])
    got = _greedy(llm, prompts[:2], ["a", "a"])
    assert got == [peft_greedy(ref, p, "c", 12) for p in prompts[:2]]
    llm.engine.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


@pytest.mark.gpu
def test_graph_logits_match_eager(tiny_model_dir) -> None:
    path = tiny_model_dir("llama-gqa")
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=128)
    outs = []
    for eager in (True, False):
        llm = LLM(path, enforce_eager=eager, **kw)
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
        outs.append(llm.generate([[5] * 9, [6] * 30, [7] * 3], sp))
    for a, b in zip(*outs):
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert pa.keys() == pb.keys()
            for k in pa:
                assert abs(pa[k].logprob - pb[k].logprob) < 1e-4


def test_graph_inputs_are_the_eager_inputs_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay path without a GPU: a recording model and a graph that re-runs the forward on
    replay show what the captured graph reads. Each step's live rows hold the ``StepInputs`` the
    eager path uses; rows past the batch (also after it shrinks) hold the padding (scratch slot,
    one token of context, the scratch block); the LoRA runs buffer holds the step's runs."""
    from types import SimpleNamespace

    import torch

    from lorastar.engine.cuda_graphs import DecodeGraphs
    from lorastar.engine.input_batch import InputBatch
    from lorastar.engine.request import Request
    from lorastar.engine.sampling import SamplingParams as SP
    from lorastar.engine.scheduler import ScheduledSeq
    from lorastar.forward_context import lora_ranges, slot_runs

    seen: list[dict[str, torch.Tensor]] = []

    class Recorder:
        def __call__(self, ids: torch.Tensor, pos: torch.Tensor, ctx) -> torch.Tensor:  # noqa: ANN001
            md = ctx.attn
            seen.append(
                {
                    "ids": ids.clone(), "pos": pos.clone(), "slots": md.slot_mapping.clone(),
                    "seq_lens": md.seq_lens.clone(), "tables": md.block_tables.clone(),
                    "runs": ctx.lora.slot_runs.clone() if ctx.lora is not None else None,
                }
            )  # fmt: skip
            return torch.stack([ids, pos], 1).float()  # [n, 2]

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return hidden

    class ReplayGraph:
        def __init__(self, graphs: DecodeGraphs, n: int, with_lora: bool) -> None:
            self.args = graphs, n, with_lora
            self.out = graphs._forward(n, with_lora)

        def replay(self) -> None:
            graphs, n, with_lora = self.args
            self.out.copy_(graphs._forward(n, with_lora))

    def capture(self: DecodeGraphs, n: int, with_lora: bool):  # noqa: ANN202
        g = ReplayGraph(self, n, with_lora)
        return g, g.out

    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    bs, scratch, max_loras = 4, 50, 3
    caches = [(torch.zeros(scratch + 1, bs, 1, 2), torch.zeros(scratch + 1, bs, 1, 2))]
    lora_state = SimpleNamespace(max_loras=max_loras, max_rank=8, layout_version=0)
    graphs = DecodeGraphs(
        Recorder(), caches, [1.0], [1.0], block_size=bs, max_model_len=64, scratch_block=scratch,
        max_batch=24, lora_state=lora_state,  # type: ignore[arg-type]
    )  # fmt: skip
    batch = InputBatch(bs, 64, fill=scratch)
    adapter_slot = {"x": 2, "y": 0}
    seqs = []
    for i in range(17):
        key = [None, "x", "y"][i % 3]
        seq = Request(f"r{i}", None, list(range(3 + i)), SP(max_tokens=4), adapter_key=key).sequences[0]
        seq.block_table = [(7 * i + j) % scratch for j in range(-(-(4 + i) // bs))]
        seqs.append(seq)
    for b, with_adapters in ((17, True), (5, False), (3, True)):
        step = [ScheduledSeq(s, s.num_tokens - 1, 1) for s in seqs[:b]]
        inputs = batch.prepare(step, adapter_slot if with_adapters else None)
        ranges = lora_ranges(inputs.lora_runs) if inputs.lora_runs is not None else None
        logits = graphs.run(inputs, ranges)
        assert logits is not None and logits.shape == (b, 2)
        assert logits[:, 0].long().tolist() == inputs.input_ids.tolist()  # row order
        got = seen[-1]
        n = graphs.padded_size(b)
        assert n is not None and got["ids"].shape == (n,)
        assert got["ids"][:b].tolist() == inputs.input_ids.tolist()
        assert got["pos"][:b].tolist() == inputs.positions.tolist()
        assert got["slots"][:b].tolist() == inputs.slot_mapping.tolist()
        assert got["seq_lens"][:b].tolist() == inputs.seq_lens.tolist()
        width = inputs.block_tables.shape[1]
        assert got["tables"][:b, :width].tolist() == inputs.block_tables.tolist()
        pad = slice(b, n)
        assert (got["ids"][pad] == 0).all() and (got["pos"][pad] == 0).all()
        assert (got["slots"][pad] == scratch * bs).all() and (got["seq_lens"][pad] == 1).all()
        assert (got["tables"][pad, 0] == scratch).all()
        if with_adapters:
            assert got["runs"].tolist() == slot_runs(ranges or [], max_loras).tolist()
        else:
            assert got["runs"] is None


@pytest.mark.gpu
def test_dropped_llm_frees_gpu_memory_at_once(tiny_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """With CUDA graphs captured, adapters in slots and penalized async steps, the last reference
    gone frees the engine's GPU memory at once: no cyclic GC needed (one engine after another
    ran out of memory on an H100 when a reference cycle held each engine until a collection)."""
    import gc

    import torch

    from tests.conftest import make_peft_adapter

    path = tiny_model_dir("llama-gqa")
    adapter = make_peft_adapter(path, tmp_path / "a", 0)

    def use_and_drop() -> tuple[int, int]:
        llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=2048, max_loras=2, max_lora_rank=8)
        llm.load_adapter("a", adapter)
        _greedy(llm, [[5] * 7, [6] * 9, [7] * 3], ["a", None, "a"])
        sp = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=6, repetition_penalty=1.2)
        llm.generate(["x y z"], sp, adapter="a")
        assert _graphs_used(llm)
        used = torch.cuda.memory_allocated()
        del llm
        torch.cuda.synchronize()
        return used, torch.cuda.memory_allocated()

    gc.collect()
    gc.disable()
    try:
        use_and_drop()  # first use: kernels compiled, cuBLAS workspace allocated (kept by torch)
        before = torch.cuda.memory_allocated()
        used, after = use_and_drop()
    finally:
        gc.enable()
    assert used - before > 4 << 20, (before, used)  # the KV cache alone is several MiB
    assert after - before < (used - before) / 10, (before, used, after)


@pytest.mark.gpu
def test_auto_sized_kv_cache_sees_no_cached_weight_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stacking the slots' A rows under the base weights (layers/lora.py) copies every stacked
    linear's weight; the replaced copies must not shrink an auto-sized KV cache, which takes 80% of
    the memory left after the live weights. ``mem_get_info`` counts torch's cache as used, and
    empty_cache cannot return freed bytes in segments a live tensor shares (on an H100, ~100 MB of a
    230 MB model's copies stayed so): the cache counts them free. Measured from outside: what the
    KV cache misses of 80% of (free memory before the engine - its live tensors), or takes over it,
    is under a quarter of the stacked weights. A model whose stacked weights (~230 MB in fp32) dwarf
    the allocator's leftovers."""
    import gc

    import torch

    from tests import conftest

    wide = dict(arch="llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    monkeypatch.setitem(conftest.TINY_CONFIGS, "llama-wide", wide)
    path = conftest.make_tiny_model(tmp_path / "m", "llama-wide")
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    free0 = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - before
    llm = LLM(path, device="cuda", dtype="float32", max_loras=2, max_lora_rank=8, max_num_seqs=4,
              enforce_eager=True)  # fmt: skip
    stacked = [lora.stacked for _, lora in llm.engine.lora_state.slots if lora.stacked is not None]
    assert len(stacked) == len(llm.engine.lora_state.slots) > 0
    stacked_bytes = sum(t.numel() * t.element_size() for t in stacked)
    assert stacked_bytes > 200 << 20, stacked_bytes
    spec = llm.engine.kv_spec
    kv_bytes = spec.num_blocks * spec.bytes_per_block
    live = torch.cuda.memory_allocated() - before - kv_bytes  # weights, stacked slots, buffers
    missed = 0.8 * (free0 - live) - kv_bytes
    assert abs(missed) < stacked_bytes / 4, (missed, kv_bytes, live, stacked_bytes)  # neither side
    out = llm.generate([[5] * 9], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
