"""``thinking_token_budget`` (vLLM's): once a thinking block holds that many tokens, its end tag is
the only token allowed. On the embedded SmolLM2 with ordinary tokens standing in for the tags:
greedy output equals transformers' greedy up to the budget, then the end tag, then transformers'
greedy continuation of that; a block the model closes itself, or an output that opens none, is
untouched."""

from __future__ import annotations

import pytest
import torch

from lorastar import LLM, SamplingParams
from lorastar.engine.thinking_budget import ThinkingBudget
from lorastar.errors import InvalidParamError

MESSAGES = [{"role": "user", "content": "Describe a cat called Tom, aged 3, as JSON."}]
NEW = 12


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, num_kv_blocks=128, max_model_len=512)


@pytest.fixture(scope="module")
def hf(model_dir: str) -> tuple[list[int], object]:
    """The prompt's ids and transformers' greedy continuation of any prefix."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)

    def greedy(prefix: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prefix]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
        return out[0, len(prefix) :].tolist()

    return list(ids), greedy


def test_greedy_output_is_transformers_up_to_the_budget_then_the_end_tag(llm: LLM, hf: tuple) -> None:
    ids, greedy = hf
    free = greedy(ids, NEW)
    end = free[3]  # a token the model writes later stands for </think>: the budget brings it forward

    def run(**kw: object) -> list[int]:
        return list(
            llm.generate([ids], SamplingParams(temperature=0, max_tokens=NEW, **kw))[0].outputs[0].token_ids
        )

    def forced(prefix: list[int]) -> list[int]:
        return [*prefix, end, *greedy([*ids, *prefix, end], NEW - len(prefix) - 1)]

    # DeepSeek-R1's style (the prompt ends inside the block): the first tokens are the block
    for budget in (0, 1, 2):
        assert run(reasoning_end_token_id=end, thinking_token_budget=budget) == forced(free[:budget]), budget
    # Qwen3's style: the first token opens the block (here: the model's own first token)
    got = run(reasoning_start_token_id=free[0], reasoning_end_token_id=end, thinking_token_budget=1)
    assert got == forced(free[:2])
    # a message before the end tag once the budget is spent: the model's words stand in for it
    message = [free[6], free[5]]
    got = run(reasoning_end_token_id=end, thinking_token_budget=1, thinking_budget_message_ids=message)
    assert got == forced([free[0], *message])
    # closed by the model within its budget, or no block opened: the budget changes nothing
    assert run(reasoning_end_token_id=end, thinking_token_budget=3) == free
    assert run(reasoning_end_token_id=free[1], thinking_token_budget=2) == free
    assert run(reasoning_start_token_id=free[1], reasoning_end_token_id=end, thinking_token_budget=0) == free


def test_sampled_and_forked_rows_end_their_blocks_at_the_budget(llm: LLM, hf: tuple) -> None:
    ids, greedy = hf
    end = greedy(ids, 4)[3]
    params = SamplingParams(
        temperature=1.0, seed=7, n=3, max_tokens=NEW, reasoning_end_token_id=end, thinking_token_budget=2
    )
    outs = llm.generate([ids], params)[0].outputs
    assert len(outs) == 3
    for o in outs:  # each sample's own block: the end tag by its third token at the latest
        assert end in o.token_ids[:3], o.token_ids


def test_the_budget_needs_an_end_tag_and_a_count(llm: LLM) -> None:
    with pytest.raises(InvalidParamError, match="reasoning_end_token_id") as e:
        SamplingParams(thinking_token_budget=5)
    assert e.value.param == "thinking_token_budget"
    with pytest.raises(InvalidParamError, match="use_beam_search") as e:  # beams read the raw logits
        SamplingParams(thinking_token_budget=0, reasoning_end_token_id=1, use_beam_search=True, n=2)
    assert e.value.param == "thinking_token_budget"
    with pytest.raises(InvalidParamError, match="needs thinking_token_budget") as e:
        SamplingParams(thinking_budget_message_ids=[1], reasoning_end_token_id=1)
    assert e.value.param == "thinking_budget_message_ids"
    for bad_ids in ([-1], "ab", [1.5], [0] * 65):
        with pytest.raises(InvalidParamError, match="at most 64 token ids"):
            SamplingParams(
                thinking_budget_message_ids=bad_ids, thinking_token_budget=1, reasoning_end_token_id=1
            )  # type: ignore[arg-type]
    with pytest.raises(InvalidParamError, match="outside the vocabulary") as e:
        llm.generate("hi", SamplingParams(thinking_budget_message_ids=[10**6], thinking_token_budget=1,
                                          reasoning_end_token_id=1))  # fmt: skip
    assert e.value.param == "thinking_budget_message_ids"
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidParamError, match="integer >= 0") as e:
            SamplingParams(thinking_token_budget=bad, reasoning_end_token_id=1)  # type: ignore[arg-type]
        assert e.value.param == "thinking_token_budget"


def test_the_block_is_followed_lazily_over_the_output() -> None:
    start, end, word = 5, 6, 9
    r1 = ThinkingBudget(2, None, end)  # open from the first token
    assert (
        r1.next_forced([]) is None and r1.next_forced([word]) is None and r1.next_forced([word, word]) == end
    )
    assert r1.next_forced([word, word, end]) is None and r1.next_forced([word, word, end, word, word]) is None
    late = ThinkingBudget(2, None, end)  # built after the output grew (a fork, a rebuilt row)
    assert late.next_forced([word, word]) == end and late.count == 2
    assert ThinkingBudget(0, None, end).next_forced([]) == end
    q = ThinkingBudget(1, start, end)  # Qwen3's: open only if the first token opens it
    assert (
        q.next_forced([]) is None and q.next_forced([start]) is None and q.next_forced([start, word]) == end
    )
    assert ThinkingBudget(0, start, end).next_forced([start]) == end
    assert ThinkingBudget(0, start, end).next_forced([word]) is None  # no block: never
    assert ThinkingBudget(0, start, end).next_forced([word, start]) is None  # a later start is text
    m = ThinkingBudget(1, None, end, message=[7, 8])  # the message, then the end tag
    assert [m.next_forced([word][:k] + [7, 8][: max(0, k - 1)]) for k in range(4)] == [None, 7, 8, end]
    assert ThinkingBudget(1, None, end, message=[7, 8]).next_forced([word, 7, 8]) == end  # a late row too


def test_with_async_scheduling_a_budget_keeps_the_overlap(model_dir: str, hf: tuple) -> None:
    """A budgeted request never runs steps one at a time under async scheduling: each step
    launches while the one before is in flight, which completes before the budget reads the
    output. The tokens equal the engine's without async scheduling, for a block the model closes
    and one the budget closes."""
    ids, greedy = hf
    free = greedy(ids, NEW)
    end = free[3]
    cases = [
        {"reasoning_end_token_id": free[1], "thinking_token_budget": 4},  # the model closes it
        {"reasoning_end_token_id": end, "thinking_token_budget": 1},  # the budget closes it
    ]
    want = LLM(model_dir, num_kv_blocks=64, max_model_len=256).generate(
        [ids] * 2, [SamplingParams(temperature=0, max_tokens=NEW, **kw) for kw in cases]
    )
    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=256, async_scheduling=True)
    eng = llm.engine
    for w, kw in zip(want, cases):
        eng.add_request(ids, SamplingParams(temperature=0, max_tokens=NEW, **kw), request_id="r")
        holding, in_flight, got = [], [], None
        while eng.has_unfinished():
            holding.append(eng._num_sync_requests)
            for o in eng.step():  # cumulative outputs: the last is the whole answer
                got = list(o.outputs[0].token_ids)
            in_flight.append(eng._inflight is not None)
        assert not any(holding) and sum(in_flight) >= NEW - 1, (holding, in_flight)
        assert got == list(w.outputs[0].token_ids)
        eng.check_invariants()
        assert eng._num_host_readers == 0 and llm.kv_cache_usage()["num_used_blocks"] == 0
