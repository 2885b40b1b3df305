"""Speculative decoding for requests whose sampling follows its output: a JSON schema, regex or
grammar (xgrammar's matcher steps through the drafts and rolls back), ``guided_choice`` and a
thinking budget. On the embedded SmolLM2, drafts from an oracle (the reference continuation, some
drafts spoiled): greedy outputs equal transformers under xgrammar's own logits processor, or
transformers' greedy with the budget's forced tokens; a choice's equal the engine's without
drafts (``tests/engine/test_structured_outputs.py`` holds those to xgrammar), seeded samples too.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
import xgrammar as xgr

from lorastar import LLM, SamplingParams
from lorastar.engine import engine as engine_mod
from lorastar.engine.grammar_mask import bitmask_to_bool
from lorastar.engine.structured import ENDED, MASKED, GrammarRow
from lorastar.engine.thinking_budget import ThinkingBudget
from tests.engine.test_spec_decode import _drained, _llm
from tests.engine.test_structured_outputs import EBNF, MESSAGES, REGEX, SCHEMA, _satisfies

VOCAB = 49152


@pytest.fixture(scope="module")
def hf(model_dir: str) -> tuple[Any, Any, list[int], Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.config.vocab_size)
    return tok, model, list(ids), xgr.GrammarCompiler(info)


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    """SmolLM2 drafting 4 tokens a step, its invariants checked after every step."""
    return _llm(model_dir, num_kv_blocks=128)


def _draft(
    monkeypatch: pytest.MonkeyPatch,
    prompt: list[int],
    ref: list[int],
    spoil: int | str | None,
    others: dict[int, int] | None = None,
) -> list[tuple[int, list[int]]]:
    """Drafts of ``ref`` (the reference output of ``prompt``) at every step. ``spoil``: None keeps
    them; an int k puts ``t + 1`` at every k-th position (mostly a token a grammar refuses);
    "others" puts ``others[i]`` (a token the grammar allows, the model does not) wherever there is
    one; "last" spoils only the last draft of each proposal (with ``others`` or ``t + 1``), so a
    step keeps all but one and its matcher must give back exactly the one it stepped through.
    Returns the log of proposals: (output length, drafts)."""
    log: list[tuple[int, list[int]]] = []

    def propose(tokens: np.ndarray, lo: int, hi: int, k: int) -> list[int]:
        toks = tokens.tolist()
        if toks[: len(prompt)] != prompt:
            return []
        done = len(toks) - len(prompt)
        out = ref[done : done + k]
        alt = others or {}
        if isinstance(spoil, int):
            out = [t + 1 if (done + i) % spoil == 0 else t for i, t in enumerate(out)]
        elif spoil == "others":
            out = [alt.get(done + i, t) for i, t in enumerate(out)]
        elif spoil == "last" and out:
            i = done + len(out) - 1
            out = [*out[:-1], alt.get(i, out[-1] + 1)]
        log.append((done, out))
        return out

    monkeypatch.setattr(engine_mod, "propose_ngram", propose)
    return log


def _grammar_allows(compiled: Any, output: list[int], drafts: list[int]) -> int:
    """How many leading ``drafts`` a fresh matcher of ``compiled`` accepts after ``output``."""
    matcher = xgr.GrammarMatcher(compiled)
    assert all(matcher.accept_token(t) for t in output)
    k = 0
    while k < len(drafts) and not matcher.is_terminated() and matcher.accept_token(drafts[k]):
        k += 1
    return k


def _allowed_others(compiled: Any, ref: list[int]) -> dict[int, int]:
    """At each position of ``ref`` where its grammar allows another token, the smallest such."""
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    others: dict[int, int] = {}
    for i, t in enumerate(ref):
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(mask)
        allowed = bitmask_to_bool(mask, VOCAB)[0].nonzero().flatten().tolist()
        other = next((a for a in allowed if a != t), None)
        if other is not None:
            others[i] = other
        assert matcher.accept_token(t)
    return others


def _hf_constrained(hf: tuple, prompt: list[int], compiled: Any, n: int = 48) -> list[int]:
    tok, model, _, _ = hf
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id, logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)],
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


CASES = {
    "guided_json": (SCHEMA, lambda c: c.compile_json_schema(json.dumps(SCHEMA))),
    "guided_regex": (REGEX, lambda c: c.compile_regex(REGEX)),
    "guided_grammar": (EBNF, lambda c: c.compile_grammar(EBNF)),
}


@pytest.mark.parametrize("field", list(CASES))
def test_greedy_structured_with_drafts_equals_transformers(
    hf: tuple, llm: LLM, monkeypatch: pytest.MonkeyPatch, field: str
) -> None:
    """Every draft position kept, refused by the grammar, or allowed by it but not the model's: the
    tokens are HF's under xgrammar's processor. The reference ends with EOS, which is drafted too
    (the matcher terminates on it, then rolls back). Drafts past the first the grammar refuses are
    not run (vLLM's rule): the drafted tokens are exactly the proposals' allowed prefixes."""
    tok, _, ids, compiler = hf
    value, compile_ = CASES[field]
    compiled = compile_(compiler)
    ref = _hf_constrained(hf, ids, compiled)
    assert ref[-1] == tok.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=48, **{field: value})
    stats = llm.engine.spec_stats
    others = _allowed_others(compiled, ref)
    refused = 0
    for spoil, alt in ((None, None), (2, None), (3, None), ("others", others), ("last", None), ("last", others)):  # fmt: skip
        kept, drafted = stats.num_accepted_tokens, stats.num_draft_tokens
        log = _draft(monkeypatch, ids, ref, spoil, alt)
        (o,) = llm.generate([ids], params)
        got = o.outputs[0]
        assert got.token_ids == ref[: len(got.token_ids)], (spoil, alt, got.text)
        assert got.finish_reason == "stop"
        assert got.text == tok.decode(ref, skip_special_tokens=True)
        assert _satisfies(field, got.text)
        ran = stats.num_draft_tokens - drafted
        allowed = [_grammar_allows(compiled, ref[:done], out) for done, out in log]
        assert ran == sum(allowed)
        refused += sum(a < len(out) for a, (_, out) in zip(allowed, log))
        assert stats.num_accepted_tokens > kept
        if spoil is None:
            assert stats.num_accepted_tokens - kept == ran
        if spoil == "others":
            assert stats.num_accepted_tokens - kept < ran
        _drained(llm)
    assert refused, "some proposals held drafts the grammar refuses"


def test_json_after_a_reasoning_block_with_drafts_equals_transformers(
    hf: tuple, llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafts that cross the end of a reasoning block: free before it, the schema after (the
    matcher's reasoning state is taken back with it)."""
    tok, model, ids, compiler = hf
    dot = tok.convert_tokens_to_ids("json")
    lead = xgr.Grammar.from_ebnf("root ::= [ \\t\\n\\r]{0,4}")
    schema = xgr.Grammar.from_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compiled = compiler.compile_grammar(xgr.Grammar.concat(lead, schema))
    with torch.inference_mode():
        think = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=dot)
    assert think[0, -1].item() == dot
    block = think[0, len(ids) :].tolist()
    ref = block + _hf_constrained(hf, think[0].tolist(), compiled, 40)
    params = SamplingParams(
        temperature=0,
        max_tokens=80,
        guided_json=SCHEMA,
        disable_any_whitespace=True,
        reasoning_end_token_id=dot,
    )
    for spoil in (None, 3, "last"):
        _draft(monkeypatch, ids, ref, spoil)
        (o,) = llm.generate([ids], params)
        got = o.outputs[0]
        assert got.token_ids == ref[: len(got.token_ids)] and got.finish_reason == "stop", got.text
        assert len(got.token_ids) > len(block) + 5
        _drained(llm)


def _forced(budget: int, message: list[int], tag: int, out: list[int], p: int) -> int | None:
    """The token a thinking budget forces at output position ``p`` after ``out[:p]``: the block
    opens with the output (no start tag) and the message's tokens count as the block's."""
    k = p - budget
    return None if tag in out[:p] or not 0 <= k <= len(message) else [*message, tag][k]


def test_thinking_budget_with_drafts_equals_transformers(
    hf: tuple, llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget's message and end tag forced at drafted positions: HF's greedy up to the budget,
    the forced tokens, then HF's greedy again (``test_thinking_budget.py``'s reference). Drafts
    past the first one other than a forced token are not run."""
    _, model, ids, _ = hf
    stats = llm.engine.spec_stats

    def greedy(prefix: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prefix]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
        return out[0, len(prefix) :].tolist()

    new = 16
    free = greedy(ids, new)
    end = next(t for t in free[8:] if t not in free[:8])  # stands for </think>: the budget brings it forward
    message = [free[6], free[5]]
    # The model's own token at a position where "last" spoils the draft (1-4 are drafted first,
    # all but the 4th kept; then 5-8, ...) stands for an end tag it writes within the budget.
    closes = next(p for p in (4, 8, 12) if free[p] not in free[:p])
    refused = 0
    cases = [  # (budget, message, end tag, the output up to the end tag)
        (2, [], end, [*free[:2], end]),  # the end tag forced at the 3rd, 4th, 5th output position
        (1, message, end, [free[0], *message, end]),
        (4, [], end, [*free[:4], end]),
        (closes + 2, [], free[closes], free[: closes + 1]),  # closed by the model: nothing forced
    ]
    for budget, msg, tag, forced in cases:
        ref = [*forced, *greedy([*ids, *forced], new - len(forced))]
        params = SamplingParams(
            temperature=0, max_tokens=new, reasoning_end_token_id=tag, thinking_token_budget=budget,
            thinking_budget_message_ids=msg or None,
        )  # fmt: skip
        for spoil in (2, "last"):
            kept, drafted = stats.num_accepted_tokens, stats.num_draft_tokens
            log = _draft(monkeypatch, ids, ref, spoil)
            (o,) = llm.generate([ids], params)
            assert list(o.outputs[0].token_ids) == ref, (budget, spoil)
            assert stats.num_accepted_tokens > kept
            cut = [
                next((i for i, t in enumerate(out) if _forced(budget, msg, tag, [*ref[:done], *out], done + i) not in (None, t)), len(out))
                for done, out in log
            ]  # fmt: skip
            assert stats.num_draft_tokens - drafted == sum(cut), (budget, spoil)
            refused += sum(c < len(out) for c, (_, out) in zip(cut, log))
            _drained(llm)
    assert refused, "some proposals held drafts other than a forced token"


def test_choice_and_seeded_json_with_drafts_equal_plain_steps(
    model_dir: str, hf: tuple, llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A choice of several tokens (greedy), and seeded sampled JSON and regex (the generator is
    rewound to one draw per kept token): drafted, the outputs are those of plain steps."""
    ids = hf[2]
    plain = LLM(model_dir, num_kv_blocks=128, max_model_len=512)
    cases = [
        SamplingParams(temperature=0, max_tokens=24, guided_choice=["a black cat", "a white cat named Tom"]),
        SamplingParams(temperature=0.8, seed=11, max_tokens=48, guided_json=SCHEMA),
        SamplingParams(temperature=1.0, seed=5, max_tokens=24, guided_regex=REGEX),
    ]
    for params in cases:
        (want,) = plain.generate([ids], params)
        ref = list(want.outputs[0].token_ids)
        assert want.outputs[0].finish_reason == "stop" and len(ref) > 3
        for spoil in (2, "last"):
            kept = llm.engine.spec_stats.num_accepted_tokens
            _draft(monkeypatch, ids, ref, spoil)
            (o,) = llm.generate([ids], params)
            assert list(o.outputs[0].token_ids) == ref and o.outputs[0].text == want.outputs[0].text
            assert llm.engine.spec_stats.num_accepted_tokens > kept
            _drained(llm)


def test_grammar_row_and_budget_restore_after_drafted_positions(hf: tuple) -> None:
    """A row that stepped through drafts (kept, refused, EOS ending the grammar) and is restored
    gives the masks of a row that never saw them."""
    tok, _, _, compiler = hf
    eos = tok.eos_token_id
    compiled = compiler.compile_grammar('root ::= "yes" | "no" | "yes sir"')
    yes = tok.encode("yes", add_special_tokens=False)
    sir = tok.encode(" sir", add_special_tokens=False)
    mask = xgr.allocate_token_bitmask(1, VOCAB)

    def allowed(row: GrammarRow, output: list[int]) -> list[int] | str:
        state = row.fill(output, mask, 0)
        return bitmask_to_bool(mask, VOCAB)[0].nonzero().flatten().tolist() if state == MASKED else state

    fresh = GrammarRow(compiled, [eos])
    row = GrammarRow(compiled, [eos])
    assert allowed(row, []) == allowed(fresh, [])
    state = row.checkpoint()
    after_yes = allowed(row, yes)
    assert {eos, sir[0]} <= set(after_yes) and row.steps == len(yes)
    assert allowed(row, [*yes, eos]) == ENDED and row.matcher.is_terminated()  # drafted EOS
    row.restore(state)
    assert row.steps == 0 and not row.matcher.is_terminated()
    assert allowed(row, [*yes, *sir]) == allowed(GrammarRow(compiled, [eos]), [*yes, *sir]) == [eos]
    state = row.checkpoint()
    assert allowed(row, [*yes, *sir, 7]) == ENDED and row.off  # a refused draft
    row.restore(state)
    assert not row.off and allowed(row, [*yes, *sir]) == [eos]

    budget = ThinkingBudget(1, None, 9, (4, 5))
    assert budget.next_forced([1]) == 4
    mark = budget.checkpoint()
    assert budget.next_forced([1, 4]) == 5 and budget.next_forced([1, 4, 5]) == 9
    budget.restore(mark)
    assert budget.next_forced([1]) == 4 and budget.next_forced([1, 4, 9]) is None


def test_drafts_are_cut_at_the_first_one_the_grammar_or_choice_refuses(hf: tuple) -> None:
    """``valid_drafts`` reads the output for good and leaves the matcher as it was after it; a
    choice's drafts stop where they leave every choice's path."""
    from lorastar.engine.engine import _allowed_drafts
    from lorastar.engine.sampler import ChoicePaths, SamplingRow

    tok, _, _, compiler = hf
    eos = tok.eos_token_id
    compiled = compiler.compile_grammar('root ::= "yes" | "no" | "yes sir"')
    yes = tok.encode("yes", add_special_tokens=False)
    sir = tok.encode(" sir", add_special_tokens=False)
    no = tok.encode("no", add_special_tokens=False)
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    row = GrammarRow(compiled, [eos])
    assert row.valid_drafts([], [*yes, *sir, eos, 5]) == len(yes) + len(sir) + 1  # nothing after EOS
    assert row.valid_drafts([], [*no, *sir]) == len(no)
    assert row.accepted == 0 and row.steps == 0
    assert row.valid_drafts(yes, [*no]) == 0 and row.accepted == len(yes) and row.steps == len(yes)
    assert row.fill(yes, mask, 0) == MASKED
    want = xgr.allocate_token_bitmask(1, VOCAB)
    GrammarRow(compiled, [eos]).fill(yes, want, 0)
    assert torch.equal(mask, want)

    choices = ChoicePaths.from_token_ids([[11, 12, 13], [11, 14]], [eos])
    sampling = SamplingRow(SamplingParams(), [9], [11], choices=choices)
    assert _allowed_drafts(sampling, [12, 13, eos, 17]) == 3
    assert _allowed_drafts(sampling, [14, 12]) == 1
    assert _allowed_drafts(sampling, [15]) == 0

    budget = ThinkingBudget(1, None, 9, (4,))  # after one token: 4, then the end tag 9
    assert budget.valid_drafts([1], [4, 9, 7]) == 3 and budget.valid_drafts([1], [4, 5, 9]) == 1
    assert budget.valid_drafts([1], [9, 4]) == 0 and ThinkingBudget(1, None, 9).valid_drafts([], [1, 5]) == 1
    assert budget.next_forced([1]) == 4 and budget.next_forced([1, 4]) == 9  # as after the output
    sampling = SamplingRow(SamplingParams(), [9], [], thinking=ThinkingBudget(2, None, 9))
    assert _allowed_drafts(sampling, [3, 5, 7]) == 2 and _allowed_drafts(sampling, [3, 9, 7, 7]) == 4
