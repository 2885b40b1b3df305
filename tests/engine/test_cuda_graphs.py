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
def test_graphs_with_lora_match_peft_through_hot_loads(tiny_model_dir, tmp_path: Path) -> None:
    from tests.adapters.test_lora_vs_peft import make_adapters, peft_greedy, peft_reference

    base_dir = tiny_model_dir("llama-gqa")
    paths = make_adapters(base_dir, tmp_path)
    ref = peft_reference(base_dir, paths)
    llm = LLM(base_dir, device="cuda", dtype="float32", num_kv_blocks=256, max_loras=4, max_lora_rank=16)
    prompts = [[7 + i] * (5 + 3 * i) for i in range(6)]

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
