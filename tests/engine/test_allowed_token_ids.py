"""vLLM's ``allowed_token_ids`` on the embedded SmolLM2 against HF transformers: greedy decoding
limited to a set of ids equals ``generate`` with every other id suppressed (``suppress_tokens``)."""

from __future__ import annotations

import pytest
import torch

from lorastar import LLM, SamplingParams
from lorastar.errors import InvalidParamError

PROMPT = "The capital of France is"
WORDS = [" Paris", " London", " Rome", " a", " the", " city", " capital", ".", ","]


def test_greedy_allowed_token_ids_equal_transformers_suppress_tokens(model_dir: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    allowed = sorted({i for w in WORDS for i in tok(w, add_special_tokens=False)["input_ids"]})
    ids = tok(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    suppressed = [i for i in range(model.config.vocab_size) if i not in set(allowed)]
    with torch.inference_mode():
        ref = model.generate(
            torch.tensor([ids]), max_new_tokens=10, do_sample=False, suppress_tokens=suppressed,
            pad_token_id=tok.eos_token_id,
        )[0, len(ids) :].tolist()  # fmt: skip
    free = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids) :].tolist()
    assert ref != free  # the set changes what greedy picks

    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed)
    sampled = SamplingParams(
        temperature=1.0, seed=5, n=4, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed
    )
    out_greedy, out_sampled, out_free = llm.generate(
        [PROMPT] * 3, [greedy, sampled, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    )
    assert out_greedy.outputs[0].token_ids == ref
    assert out_free.outputs[0].token_ids == free  # the batch's other rows keep every id
    assert all(set(o.token_ids) <= set(allowed) for o in out_sampled.outputs)
    with pytest.raises(InvalidParamError, match="outside the vocabulary") as e:
        llm.generate(PROMPT, SamplingParams(allowed_token_ids=[model.config.vocab_size]))
    assert e.value.param == "allowed_token_ids"
    llm.engine.check_invariants()
    assert not llm.engine.requests
