"""Greedy output of the engine equals HF transformers `generate`, token for token."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorastar import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    """HF's greedy continuation of ``n`` tokens through any EOS, as ``ignore_eos`` generates: EOS
    may be chosen, it just ends nothing (``min_new_tokens`` would mask it instead, and a random
    workload whose argmax was the EOS then "failed" against a reference that could not pick it)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def mixed_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize(
    "name",
    [
        "llama-gqa",
        "llama-mha-llama3",
        "qwen2",
        "mistral",
        "qwen3",
        "qwen3-tied",
        "phi3",
        "smollm3",
        "granite",
        "olmo2",
    ],
)
def test_tiny_models_match_hf(tiny_model_dir, name: str) -> None:
    path = tiny_model_dir(name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = mixed_prompts(1, [1, 2, 15, 16, 17, 33, 80, 200])
    llm = LLM(path, num_kv_blocks=256, max_num_batched_tokens=128)  # 128: forces chunked prefill
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12), f"prompt of {len(p)} tokens"
    usage = llm.kv_cache_usage()
    assert usage["num_used_blocks"] == 0
    llm.engine.check_invariants()


def test_staggered_arrivals_match_hf(tiny_model_dir) -> None:
    """Requests join a running batch at different steps; every output still equals HF."""
    path = tiny_model_dir("llama-gqa")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = mixed_prompts(2, [5, 120, 1, 40, 64, 9])
    llm = LLM(path, num_kv_blocks=256, max_num_batched_tokens=64, enable_prefix_caching=False)
    eng = llm.engine
    done: dict[str, list[int]] = {}
    ids = []
    for i, p in enumerate(prompts):
        ids.append(eng.add_request(p, GREEDY).request_id)
        for _ in range(i + 1):  # a few steps between arrivals
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    for rid, p in zip(ids, prompts):
        assert done[rid] == hf_greedy(hf, p, 12)
    eng.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


def test_tiny_kv_cache_preempts_and_matches(tiny_model_dir) -> None:
    """With room for ~2 sequences, 6 requests finish through preemption with unchanged outputs."""
    path = tiny_model_dir("llama-gqa")
    prompts = mixed_prompts(3, [30, 45, 12, 60, 25, 50])
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = LLM(path, num_kv_blocks=256).generate(prompts, sp)
    small = LLM(path, num_kv_blocks=12, block_size=16, enable_prefix_caching=False)
    outs = small.generate(prompts, sp)
    assert small.engine.scheduler.stats.num_preemptions > 0
    for a, b in zip(ref, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert small.kv_cache_usage()["num_used_blocks"] == 0
    small.engine.check_invariants()


def test_smollm2_matches_hf() -> None:
    from lorastar.models.default import default_model_dir

    path = str(default_model_dir())
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(num_kv_blocks=128)
    tok = llm.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away, there"]
    prompts = [tok(t)["input_ids"] for t in texts] + mixed_prompts(4, [150])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 10)
    assert outs[0].outputs[0].text.startswith(" Paris")


@pytest.mark.parametrize("regime", ["short", "long"])
def test_longrope_partial_rotary_matches_hf(tiny_model_dir, regime: str) -> None:
    """Phi-4-mini's rope (3/4 of each head rotates; LongRoPE). transformers picks short or long factors
    on each forward's length; the engine picks once from max_model_len (layers/rotary.py). They agree
    when a sequence stays on one side of original_max_position_embeddings (64 here): the short regime
    with every sequence within 64 tokens, the long one with every prompt past it."""
    path = tiny_model_dir("phi4-mini")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if regime == "short":
        prompts, llm = mixed_prompts(8, [1, 9, 33, 50]), LLM(path, num_kv_blocks=64, max_model_len=64)
    else:
        prompts, llm = mixed_prompts(9, [65, 80, 200]), LLM(path, num_kv_blocks=64, max_num_batched_tokens=64)
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12), f"prompt of {len(p)} tokens"
    # Logits of the longest prompt's last position, within 1e-4 relative.
    eng = llm.engine
    eng.add_request(prompts[-1], SamplingParams(temperature=0, max_tokens=1))
    out = eng.scheduler.schedule()
    while out.scheduled and not out.scheduled[0].samples:  # chunked prefill: run to the last chunk
        eng.runner.execute(out, None)
        eng.scheduler.update(out)
        out = eng.scheduler.schedule()
    got = eng.runner.execute(out, None).logits[0]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([prompts[-1]])).logits[0, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
