"""Length boundaries: a prompt whose length is an exact multiple of the block size, preempted in the
middle of its chunked prefill while another request holds its whole prompt in the prefix cache,
must still compute its last prompt token when it comes back (vLLM's rule: a prefix-cache hit never
covers the last token, whose logits give the first output), so its greedy output equals the roomy,
unchunked run's."""

from __future__ import annotations

from typing import Any

import pytest

from lorastar import LLM, SamplingParams
from lorastar.engine.block_manager import BlockManager
from lorastar.engine.request import Request

_MAX_LEN = 32


def _prompt(n: int) -> list[int]:
    return [(31 * i) % 1990 + 3 for i in range(n)]  # every prompt a prefix of the longer ones


def test_lookup_never_covers_the_last_token_after_a_preemption() -> None:
    """The hash chain the scheduler memoises at admission covers every full prompt block; a lookup
    after the sequence was preempted must still stop one token short of the prompt's end."""
    bm = BlockManager(8, 4)
    owner = Request("owner", None, _prompt(12), SamplingParams()).sequences[0]
    assert bm.allocate(owner, 12) == []
    owner.num_computed_tokens = 12
    bm.commit(owner)  # its first 8 tokens (2 blocks) are the other prompt whole
    seq = Request("seq", None, _prompt(8), SamplingParams()).sequences[0]
    hits = bm.lookup(seq)
    assert len(hits) == 1
    assert bm.allocate(seq, 2, hits) == []
    bm.hashes(seq, 2)  # what the scheduler does on admission (in-flight prompt blocks)
    bm.free(seq)  # preempted mid-prefill
    assert len(bm.lookup(seq)) == 1


@pytest.fixture(scope="module")
def model_path(tiny_model_dir: Any) -> str:
    return str(tiny_model_dir("llama-gqa"))


def test_preempted_mid_prefill_full_prompt_hit_keeps_greedy_output(model_path: str) -> None:
    lens = [28, 24, 16, 8]  # the 8-token prompt is chunked, preempted, then fully cached by the 28
    reqs = [{"prompt_token_ids": _prompt(n)} for n in lens]
    params = [
        SamplingParams(temperature=0, max_tokens=_MAX_LEN - n, ignore_eos=True, logprobs=1) for n in lens
    ]
    roomy = LLM(model_path, max_model_len=_MAX_LEN, num_kv_blocks=64, block_size=4, max_num_batched_tokens=64)
    want = [roomy.generate([r], p, use_tqdm=False)[0] for r, p in zip(reqs, params, strict=True)]
    tight = LLM(
        model_path, max_model_len=_MAX_LEN, num_kv_blocks=12, block_size=4, max_num_batched_tokens=8,
        max_num_seqs=4,
    )  # fmt: skip
    got = tight.generate(reqs, params, use_tqdm=False)
    assert tight.engine.scheduler.stats.num_preemptions > 0
    assert tight.engine.block_manager.num_used_blocks == 0
    for n, w, g in zip(lens, want, got, strict=True):
        cw, cg = w.outputs[0], g.outputs[0]
        assert list(cg.token_ids) == list(cw.token_ids), n
        assert (len(cg.token_ids), cg.finish_reason) == (_MAX_LEN - n, "length")
        for a, b in zip(cw.logprobs, cg.logprobs, strict=True):
            assert set(a) == set(b)
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-3) for t in a)
