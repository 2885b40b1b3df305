"""Sliding-window attention in the paged cache: greedy tokens and logits equal HF transformers for
sequences several windows long, and a model windowed on every layer stops growing its KV blocks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorastar import LLM, SamplingParams
from lorastar.engine.block_manager import NULL_BLOCK
from tests.models.test_llama_vs_hf import hf_greedy, mixed_prompts

LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _run_recording_logits(llm: LLM, prompts: list[list[int]], sp: SamplingParams, gap: int = 2):
    """Run ``prompts`` arriving ``gap`` steps apart; record each sampled row's logits by the token
    sequence it continues. Returns (token ids per prompt, {tuple(tokens): logits})."""
    eng = llm.engine
    seen: dict[tuple[int, ...], torch.Tensor] = {}
    execute = eng.runner.execute

    def recording(out, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        res = execute(out, *a, **kw)
        rows = [s for s in out.scheduled if s.samples]
        for s, row in zip(rows, res.logits):
            seen[tuple(s.seq.token_ids[: s.start + s.num_new_tokens])] = row.clone()
        return res

    eng.runner.execute = recording  # type: ignore[method-assign]
    done: dict[str, list[int]] = {}
    ids = []

    def drain() -> None:
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
            eng.check_invariants()

    for p in prompts:
        ids.append(eng.add_request(p, sp).request_id)
        for _ in range(gap):
            drain()
    while eng.has_unfinished():
        drain()
    return [done[r] for r in ids], seen


def assert_decodes_as_hf(hf, llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> None:  # noqa: ANN001
    """Greedy tokens of every prompt (arriving two steps apart), and the logits at every decode step
    of the last one within 1e-4 relative, equal transformers' (``hf``)."""
    outs, logits = _run_recording_logits(llm, prompts, sp)
    assert outs == [hf_greedy(hf, p, sp.max_tokens) for p in prompts]
    full = prompts[-1] + outs[-1]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([full])).logits[0]  # [L, vocab]
    for n in range(len(prompts[-1]), len(full)):
        got = logits[tuple(full[:n])]
        torch.testing.assert_close(got, want[n - 1], rtol=1e-4, atol=1e-4 * want[n - 1].abs().max().item())


@pytest.mark.parametrize(
    "name", ["mistral-window", "qwen2-window", "gemma2", "gemma3", "gemma3-mm", "smollm3-window", "olmo3"]
)
def test_windowed_models_match_hf(tiny_model_dir, name: str) -> None:
    path = tiny_model_dir(name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # Up to ~10 windows long, with chunks (32-token budget) starting inside and across windows.
    prompts = mixed_prompts(5, [1, 19, 24, 25, 50, 96, 230])
    llm = LLM(path, num_kv_blocks=128, block_size=8, max_num_batched_tokens=32)
    outs, logits = _run_recording_logits(llm, prompts, LONG)
    for p, o in zip(prompts, outs):
        assert o == hf_greedy(hf, p, LONG.max_tokens), f"prompt of {len(p)} tokens"
    # Logits of the last prompt (prefill chunks + 40 decodes past many windows) within 1e-4 relative.
    full = prompts[-1] + outs[-1]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([full])).logits[0]  # [L, vocab]
    checked = 0
    for n in range(len(prompts[-1]), len(full)):
        got = logits[tuple(full[:n])]
        torch.testing.assert_close(got, want[n - 1], rtol=1e-4, atol=1e-4 * want[n - 1].abs().max().item())
        checked += 1
    assert checked == LONG.max_tokens
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


def test_window_frees_blocks_only_when_every_layer_slides(tiny_model_dir) -> None:
    """Mistral (every layer windowed): a growing sequence holds at most ceil((W + chunk) / BS) + 1
    blocks. Qwen2 with one full layer keeps every block (the full layer reads them all)."""
    bs, chunk = 8, 32
    held: dict[str, list[int]] = {}
    for name, window in (("mistral-window", 24), ("qwen2-window", 20)):
        llm = LLM(tiny_model_dir(name), num_kv_blocks=128, block_size=bs, max_num_batched_tokens=chunk)
        eng = llm.engine
        eng.add_request(
            mixed_prompts(6, [150])[0], SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
        )
        counts = []
        while eng.has_unfinished():
            eng.step()
            eng.check_invariants()
            for seq in eng.scheduler.running:
                counts.append(sum(b != NULL_BLOCK for b in seq.block_table))
                assert eng.block_manager.num_blocks - eng.block_manager.num_free_blocks == counts[-1]
        held[name] = counts
        assert llm.kv_cache_usage()["num_used_blocks"] == 0
        if name == "mistral-window":
            assert max(counts) <= -(-(window + chunk) // bs) + 1
            assert counts[-1] <= -(-(window + 1) // bs) + 1  # decoding: the window plus the block written
        else:
            assert counts[-1] == -(-(150 + 79) // bs)  # every block of the sequence
    assert max(held["mistral-window"]) < max(held["qwen2-window"]) / 4


def test_window_with_prefix_cache_preemption_and_n(tiny_model_dir) -> None:
    """Released blocks stay reusable as a cached prefix, preemption recomputes through holes, and
    n > 1 samples share a table with holes: all outputs equal a roomy, cache-less run."""
    path = tiny_model_dir("mistral-window")
    prompts = mixed_prompts(7, [120, 90, 120])
    prompts[2] = list(prompts[0])  # the same long prompt again: its early blocks are cached
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = LLM(path, num_kv_blocks=256, block_size=8, enable_prefix_caching=False).generate(prompts, sp)
    tight = LLM(path, num_kv_blocks=14, block_size=8, max_num_batched_tokens=32)
    outs = tight.generate(prompts, sp)
    assert tight.engine.scheduler.stats.num_preemptions > 0
    for a, b in zip(ref, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    roomy = LLM(path, num_kv_blocks=64, block_size=8, max_num_batched_tokens=32)
    roomy.generate(prompts[:1], sp)
    again = roomy.generate(prompts[:1], sp)[0]
    assert roomy.engine.scheduler.stats.prefix_hits > 0
    assert again.outputs[0].token_ids == ref[0].outputs[0].token_ids
    fan = roomy.generate(prompts[1:2], SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=30))[0]
    assert len(fan.outputs) == 3
    roomy.engine.check_invariants()
    assert roomy.kv_cache_usage()["num_used_blocks"] == 0
