"""Sliding windows and KV memory over long sequences: admission counts the blocks a window frees."""

from __future__ import annotations

import pytest

from lorastar import LLM, SamplingParams
from lorastar.errors import LimitExceededError
from tests.models.test_llama_vs_hf import mixed_prompts


def test_beam_search_that_fits_thanks_to_the_window_is_admitted(tiny_model_dir) -> None:  # noqa: ANN001
    """Every layer slides (window 24): a beam holds at most ceil((24 + 32) / 8) + 2 = 9 blocks
    however long it grows, so 2 beams of 20 + 100 tokens fit 20 blocks. The admission check counted
    every block of the whole length (2 + 2 * 13 = 28) and refused it; a search that fits neither
    way is still refused."""
    path = tiny_model_dir("mistral-window")
    prompt = mixed_prompts(21, [20])[0]
    beam = SamplingParams(use_beam_search=True, n=2, temperature=0, max_tokens=100, ignore_eos=True)
    ref = LLM(path, num_kv_blocks=64, block_size=8, max_num_batched_tokens=32).generate([prompt], beam)
    tight = LLM(path, num_kv_blocks=20, block_size=8, max_num_batched_tokens=32)
    out = tight.generate([prompt], beam)[0]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ref[0].outputs]
    assert all(len(o.token_ids) == 100 for o in out.outputs)
    tight.engine.check_invariants()
    assert tight.kv_cache_usage()["num_used_blocks"] == 0
    with pytest.raises(LimitExceededError):  # 3 beams: 27 blocks by the window, 41 without
        tight.engine.add_request(prompt, SamplingParams(use_beam_search=True, n=3, max_tokens=100))
    assert not tight.engine.requests
