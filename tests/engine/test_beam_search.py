"""Beam search equals HF transformers `generate(num_beams=...)`; beams share blocks (CoW)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorastar import LLM, SamplingParams


@pytest.mark.parametrize(
    ("name", "width", "length_penalty"), [("llama-gqa", 2, 1.0), ("llama-gqa", 4, 0.5), ("qwen2", 3, 1.0)]
)
def test_beam_search_matches_hf(tiny_model_dir, name: str, width: int, length_penalty: float) -> None:
    path = tiny_model_dir(name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, num_kv_blocks=256)
    prompts = [[11, 22, 33, 44, 55], [7] * 19, list(range(100, 140))]
    sp = SamplingParams(
        n=width, use_beam_search=True, max_tokens=10, length_penalty=length_penalty, temperature=0
    )
    outs = llm.generate(prompts, sp)
    for p, out in zip(prompts, outs):
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                          do_sample=False, max_new_tokens=10, length_penalty=length_penalty,
                          early_stopping=False, pad_token_id=0)  # fmt: skip
        want = [row[len(p) :].tolist() for row in ref]
        got = [o.token_ids for o in out.outputs]
        assert got == want
    llm.engine.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


def test_beams_share_prompt_blocks(tiny_model_dir) -> None:
    llm = LLM(tiny_model_dir("llama-gqa"), num_kv_blocks=256, enable_prefix_caching=False)
    eng = llm.engine
    prompt = list(range(200, 264))  # 4 full blocks
    req = eng.add_request(prompt, SamplingParams(n=4, use_beam_search=True, max_tokens=6))
    for _ in range(3):
        eng.step()
    live = [s for s in req.sequences if not s.is_finished]
    assert len(live) == 4
    # The 4 full prompt blocks are shared by all beams, not copied per beam.
    shared = set(live[0].block_table[:4])
    assert all(set(s.block_table[:4]) == shared for s in live)
    assert all(eng.block_manager.ref_counts[b] == 4 for b in shared)
    while eng.has_unfinished():
        eng.step()
    eng.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


def test_beam_search_beside_an_unforked_n_request_matches_hf(tiny_model_dir) -> None:
    """A beam request whose prompt finishes in the same step as an ``n > 1`` request's: the
    fan-out picks its sampling rows out of the step's logits, and the beam rows must still index
    the step's own (they read a row past the end of the picked ones before the fix)."""
    path = tiny_model_dir("llama-gqa")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, num_kv_blocks=256)
    beam_prompt = [7] * 19
    fan = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=5, ignore_eos=True)
    beam = SamplingParams(n=2, use_beam_search=True, max_tokens=6, temperature=0)
    outs = llm.generate([[11, 22, 33], [5, 6], beam_prompt], [fan, fan, beam])
    ids = torch.tensor([beam_prompt])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=2, num_return_sequences=2,
                      do_sample=False, max_new_tokens=6, early_stopping=False, pad_token_id=0)  # fmt: skip
    assert [o.token_ids for o in outs[2].outputs] == [row[len(beam_prompt) :].tolist() for row in ref]
    assert [len(o.outputs) for o in outs[:2]] == [3, 3]
    llm.engine.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0
