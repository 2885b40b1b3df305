"""``EngineConfig.max_logprobs`` (vLLM's ``--max-logprobs``): the most top logprobs a request may ask
for. Over it, a request is refused naming its field, and nothing is queued; under a raised cap the
top 40 of sampled and prompt positions equal ``log_softmax`` of transformers' logits."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lorastar import LLM, SamplingParams
from lorastar.config import EngineConfig
from lorastar.errors import LimitExceededError
from tests.engine.test_prompt_logprobs import TOL, _check, _hf_logprobs

PROMPT = list(range(300, 340))


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Any) -> str:
    return tiny_model_dir("llama-gqa")


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, max_model_len=256, num_kv_blocks=64, max_logprobs=40)


def _nothing_left(llm: LLM) -> None:
    llm.engine.check_invariants()
    assert not llm.engine.requests and not llm.engine.scheduler.waiting


def test_forty_top_logprobs_equal_transformers(llm: LLM, model_dir: str) -> None:
    (o,) = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=6, logprobs=40, prompt_logprobs=32)
    )
    out = o.outputs[0]
    ref = _hf_logprobs(model_dir, [*PROMPT, *out.token_ids])  # [prompt + output, vocab]
    _check(o.prompt_logprobs, PROMPT, ref, 32)
    assert len(out.logprobs) == len(out.token_ids) == 6
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        want = ref[len(PROMPT) - 1 + i]  # [vocab]: the distribution output token i was sampled from
        assert tok == int(want.argmax())  # greedy
        top = sorted((lp for lp in entry.values() if lp.rank <= 40), key=lambda lp: lp.rank)
        assert len(top) == 40 and len(entry) == 40  # the sampled token is the first of them
        for lp, v in zip(top, want.topk(40).values.tolist(), strict=True):
            assert abs(lp.logprob - v) <= TOL
        for t, lp in entry.items():
            assert abs(lp.logprob - want[t].item()) <= TOL
    _nothing_left(llm)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_over_the_cap_is_refused_naming_the_field(llm: LLM, field: str) -> None:
    with pytest.raises(
        LimitExceededError, match=rf"^{field} must be at most 40 \(max_logprobs\), got 41"
    ) as e:
        llm.generate([PROMPT], SamplingParams(max_tokens=2, **{field: 41}))
    assert e.value.param == field
    _nothing_left(llm)
    llm.generate([PROMPT], SamplingParams(max_tokens=2, **{field: 40}))  # the cap itself is served
    _nothing_left(llm)


def test_default_cap_is_vllms_20_and_minus_one_lifts_it_to_the_vocabulary(model_dir: str) -> None:
    default = LLM(model_dir, max_model_len=64, num_kv_blocks=16)
    assert EngineConfig().max_logprobs == 20 and default.engine.max_logprobs == 20
    with pytest.raises(LimitExceededError, match="at most 20"):
        default.generate([PROMPT], SamplingParams(max_tokens=1, logprobs=21))
    with pytest.raises(LimitExceededError, match=r"^prompt_logprobs=-1 asks for the whole vocabulary"):
        default.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=-1))
    _nothing_left(default)

    vocab = default.engine.vocab_size
    lifted = LLM(model_dir, max_model_len=64, num_kv_blocks=16, max_logprobs=-1)
    assert lifted.engine.max_logprobs == vocab
    with pytest.raises(LimitExceededError, match=f"at most {vocab}"):
        lifted.generate([PROMPT], SamplingParams(max_tokens=1, logprobs=vocab + 1))
    ranks = list(range(1, vocab + 1))
    for k in (vocab, -1):  # -1: the whole vocabulary (vLLM's)
        params = SamplingParams(temperature=0, max_tokens=1, logprobs=k, prompt_logprobs=k)
        (o,) = lifted.generate([PROMPT[:3]], params)
        assert params.logprobs == params.prompt_logprobs == k  # the caller's params are left as they were
        for entry in [*o.outputs[0].logprobs, *o.prompt_logprobs[1:]]:
            assert len(entry) == vocab and sorted(lp.rank for lp in entry.values()) == ranks
            assert abs(torch.tensor([lp.logprob for lp in entry.values()]).exp().sum().item() - 1) < 1e-4
    _nothing_left(lifted)
    # Kept past the request, a full prompt block's whole-vocabulary entries (16 x 49,152, ~55 MB)
    # fill most of the kept entries' budget: a second such block evicts the first.
    cache = lifted.engine.prompt_logprobs_cache
    for start in (0, 20):
        (o,) = lifted.generate([PROMPT[start : start + 20]], SamplingParams(max_tokens=1, prompt_logprobs=-1))
        assert len(o.prompt_logprobs[16]) == vocab
        assert len(cache) == 1 and cache.num_top == 16 * vocab <= cache.max_top


def test_kept_prompt_logprobs_are_bounded_by_their_entries() -> None:
    """``PromptLogprobsCache`` holds at most ``max_top`` top-k entries in all, least recently used
    out first; a block over the whole budget is not kept."""
    from lorastar.engine.prompt_logprobs import KeptBlock, PromptLogprobsCache

    def block(k: int) -> KeptBlock:
        return KeptBlock(k, [None] * 4, torch.zeros(2))  # 4 positions

    cache = PromptLogprobsCache(max_blocks=10, max_top=100)
    for i, k in enumerate([5, 5, 5]):
        cache.put(bytes([i]), block(k))
    assert len(cache) == 3 and cache.num_top == 60
    assert cache.get(b"\x00", 5) is not None  # now the most recent
    cache.put(b"\x03", block(11))  # 44 more (104): the least recent (1) goes
    assert cache.num_top == 84 and cache.get(b"\x01", 1) is None and cache.get(b"\x00", 5) is not None
    cache.put(b"\x02", block(7))  # a larger k replaces its block: 28 for 20
    assert cache.num_top == 92 and cache.get(b"\x02", 7) is not None
    cache.put(b"\x04", block(6))  # 24 more (116): 3 (least recent now) goes
    assert cache.num_top == 72 and cache.get(b"\x03", 1) is None and len(cache) == 3
    cache.put(b"\x05", block(26))  # 104 alone, over the budget: not kept, nothing evicted
    assert cache.get(b"\x05", 1) is None and cache.num_top == 72 and len(cache) == 3


@pytest.mark.parametrize("value", [-2, 1.5, True, "20", None])
def test_a_bad_max_logprobs_is_refused_by_name(value: object) -> None:
    with pytest.raises(ValueError, match="max_logprobs"):
        EngineConfig(max_logprobs=value)  # type: ignore[arg-type]
