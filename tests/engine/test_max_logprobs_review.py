"""Review of ``max_logprobs`` / whole-vocabulary logprobs: kept prompt logprobs at a large k.

A prefix-cache hit for prompt logprobs needs every block from the prompt's first kept: a prompt
whose blocks together are over ``PromptLogprobsCache.max_top`` used to evict its own first block
as its second was kept, leaving only blocks no later request could reach (a whole-vocabulary
40-token prompt then never hit again)."""

from __future__ import annotations

from typing import Any

import torch

from lorastar import LLM, SamplingParams
from tests.engine.test_prompt_logprobs import TOL, _hf_logprobs

PROMPT = list(range(300, 340))  # two full 16-token blocks and 8 more


def test_whole_vocabulary_prompt_logprobs_keep_a_reachable_prefix(tiny_model_dir: Any) -> None:
    model_dir = tiny_model_dir("llama-gqa")
    llm = LLM(model_dir, max_model_len=64, num_kv_blocks=16, max_logprobs=-1)
    vocab = llm.engine.vocab_size
    cache = llm.engine.prompt_logprobs_cache
    assert 2 * 16 * vocab > cache.max_top >= 16 * vocab  # one block's entries fit, not two
    ref = _hf_logprobs(model_dir, PROMPT)  # [prompt, vocab]
    for want_cached in (0, 16):  # the second run takes the first block's kept logprobs
        params = SamplingParams(max_tokens=1, prompt_logprobs=-1)
        (o,) = llm.generate([PROMPT], params)
        assert params.prompt_logprobs == -1
        assert o.num_cached_tokens == want_cached
        assert o.prompt_logprobs[0] is None
        for pos in range(1, len(PROMPT)):
            entry = o.prompt_logprobs[pos]
            assert len(entry) == vocab
            got = torch.tensor([entry[t].logprob for t in range(vocab)])
            assert (got - ref[pos - 1]).abs().max().item() <= TOL, pos
        assert cache.num_top <= cache.max_top
    llm.engine.check_invariants()
    assert not llm.engine.requests and not llm.engine.scheduler.waiting
