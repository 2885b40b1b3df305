"""No sampling parameters and no logits can break the engine (issue #10).

* The sampler, on logits with NaN, +-inf and all-masked rows, under any valid parameters, returns
  ids in ``[0, V)`` and finite logprobs.
* Property test: ``SamplingParams`` dicts drawn with extreme floats and ints are either refused with
  a ``ValueError`` naming the field, or served to the end by the real engine on a tiny model; after
  each, the engine still serves a normal greedy request with the same output as before.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lorastar import LLM, SamplingParams
from lorastar.engine.sampler import Sampler, SamplingRow
from lorastar.engine.sampling import bad_words_token_ids
from lorastar.errors import InvalidParamError
from tests.fuzzing import budget

V = 40
EXTREME_FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, -1e-300, 5e-324, 1e-45, 1e300, -1e300, 1e38, 3.5e38, 2.0, 1.0, 0.5]),
)
EXTREME_INTS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 2**31, 2**63, 2**64, -(2**63) - 1]),
)
VALID_PARAMS = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 1e-5, 1e-3, 0.7, 1.0, 100.0]),
    top_p=st.sampled_from([1e-9, 0.1, 0.9, 1.0]),
    top_k=st.sampled_from([0, 1, 3, V - 1, V, 10**9]),
    min_p=st.sampled_from([0.0, 0.5, 1.0]),
    repetition_penalty=st.sampled_from([0.01, 1.0, 100.0]),
    frequency_penalty=st.sampled_from([-2.0, 0.0, 2.0]),
    presence_penalty=st.sampled_from([-2.0, 0.0, 2.0]),
    min_tokens=st.sampled_from([0, 3]),
    max_tokens=st.just(16),
    logprobs=st.sampled_from([None, 0, 5, 20]),
    seed=st.sampled_from([None, 0, 2**64 - 1]),
)
LOGIT_ROW = st.one_of(
    st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=V, max_size=V),
    st.sampled_from(
        [[math.nan] * V, [-math.inf] * V, [math.inf] * V, [math.inf, -math.inf] * (V // 2), [0.0] * V]
    ),
)


@budget(300, derandomize=False, database=None)
@given(rows=st.lists(st.tuples(LOGIT_ROW, VALID_PARAMS), min_size=1, max_size=5), out_len=st.integers(0, 4))
def test_sampler_ids_in_range_and_logprobs_finite_whatever_the_logits(
    rows: list[tuple[list[float], SamplingParams]], out_len: int
) -> None:
    logits = torch.tensor([r for r, _ in rows], dtype=torch.float32)  # [R, V]
    sampling = [
        SamplingRow(
            p, prompt_token_ids=[1, 2, 3], output_token_ids=[4, 5, 6, 7][:out_len], eos_token_ids=(2,)
        )
        for _, p in rows
    ]
    out = Sampler(seed=0, eos_token_id=2)(logits, sampling)
    assert all(0 <= t < V for t in out.token_ids)
    for lp, (_, p) in zip(out.logprobs, rows):
        if p.logprobs is None:
            assert lp is None
            continue
        assert lp is not None and out.token_ids[out.logprobs.index(lp)] in lp
        assert all(math.isfinite(v) and rank >= 1 for v, rank in lp.values())


def test_sampler_degenerate_rows_fall_back_to_argmax() -> None:
    """A random row without finite positive mass takes its argmax (NaN counted as -inf)."""
    logits = torch.full((3, V), -math.inf)
    logits[0, 7] = math.nan
    logits[0, 9] = 1.0  # NaN is never chosen over a real value
    logits[1, 3] = math.inf
    logits[1, 4] = math.inf  # inf - inf: NaN softmax (or a split): one of the two
    p = SamplingParams(temperature=1.0, max_tokens=4)
    out = Sampler(seed=0)(logits, [SamplingRow(p, [], []) for _ in range(3)])
    assert out.token_ids[0] == 9 and out.token_ids[1] in (3, 4) and 0 <= out.token_ids[2] < V


# ---------------------------------------------------------------------- the real engine


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> LLM:
    return LLM(tiny_model_dir("llama-gqa"), num_kv_blocks=64, max_model_len=64, max_n=4, max_num_seqs=8)


FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "n": st.one_of(st.integers(1, 6), EXTREME_INTS),
    "max_tokens": st.one_of(st.integers(1, 12), EXTREME_INTS),
    "min_tokens": st.one_of(st.integers(0, 4), EXTREME_INTS),
    "temperature": EXTREME_FLOATS,
    "top_p": EXTREME_FLOATS,
    "top_k": st.one_of(st.integers(-2, 50), EXTREME_INTS),
    "min_p": EXTREME_FLOATS,
    "presence_penalty": EXTREME_FLOATS,
    "frequency_penalty": EXTREME_FLOATS,
    "repetition_penalty": EXTREME_FLOATS,
    "length_penalty": EXTREME_FLOATS,
    "seed": st.one_of(st.none(), EXTREME_INTS),
    "logprobs": st.one_of(st.none(), st.integers(-1, 25), EXTREME_INTS),
    "stop_token_ids": st.lists(EXTREME_INTS, max_size=3),
    "stop": st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "ignore_eos": st.booleans(),
    "use_beam_search": st.booleans(),
    "allowed_token_ids": st.one_of(
        st.none(), st.lists(st.one_of(st.integers(0, 60), EXTREME_INTS), max_size=3)
    ),
    "bad_words": st.one_of(st.none(), st.lists(st.text(max_size=4), max_size=3)),
    "guided_choice": st.one_of(st.none(), st.lists(st.text(max_size=4), max_size=3)),
    "guided_regex": st.one_of(st.none(), st.text(max_size=6)),  # often no regex: a refusal naming it
    "guided_json": st.one_of(
        st.none(),
        st.text(max_size=6),
        st.dictionaries(
            st.sampled_from(["type", "enum", "minLength", "maxLength", "items", "properties", "$ref"]),
            st.one_of(
                st.sampled_from(["string", "integer", "object", "array", "#/x"]),
                st.integers(-3, 3),
                st.lists(st.integers(0, 3), max_size=2),
                st.just({"a": {"type": "integer"}}),
            ),
            max_size=3,
        ),
    ),  # fmt: skip
    "guided_json_object": st.booleans(),
    "disable_any_whitespace": st.booleans(),
    "reasoning_end_token_id": st.one_of(st.none(), st.integers(0, 60), EXTREME_INTS),
    "reasoning_start_token_id": st.one_of(st.none(), st.integers(0, 60), EXTREME_INTS),
    "thinking_token_budget": st.one_of(st.none(), st.integers(0, 4), EXTREME_INTS),
    "thinking_budget_message_ids": st.one_of(
        st.none(), st.lists(st.one_of(st.integers(0, 60), EXTREME_INTS), max_size=3)
    ),
    "guided_structural_tag": st.one_of(
        st.none(),
        st.text(max_size=6),
        st.just(
            {"structures": [{"begin": "a", "schema": {"type": "integer"}, "end": "b"}], "triggers": ["a"]}
        ),
        st.just({"structures": [{"begin": 1}], "triggers": "a"}),
        st.just({"type": "structural_tag", "format": {"type": "nope"}}),
        st.dictionaries(
            st.sampled_from(["type", "format", "structures", "triggers"]),
            st.sampled_from(["structural_tag", "a", 1, [], {}]),
            max_size=3,
        ),
    ),  # fmt: skip
}


@pytest.mark.parametrize(
    "extra",
    [{"guided_json_object": True}, {"guided_choice": ["yes", "no"]}, {"guided_regex": "[a-z]+"},
     {"bad_words": ["Hello", "there"]}, {"min_tokens": 5}],
    ids=["json_object", "choice", "regex", "bad_words", "min_tokens"],
)  # fmt: skip
def test_allowed_token_ids_hold_under_every_other_constraint(llm: LLM, extra: dict[str, Any]) -> None:
    """allowed_token_ids whose ids another constraint leaves none of (a grammar or choice that
    cannot start with them, bad words that are them, min_tokens banning them as EOS): the row
    samples among its allowed ids, never outside them (the fuzz test's find: guided_json_object
    with allowed_token_ids=[1] gave token 0 sixteen times). A thinking budget that would force
    a token outside them is refused up front, naming allowed_token_ids."""
    bad = bad_words_token_ids(
        functools.partial(llm.engine.tokenizer.encode, add_special_tokens=False), ["Hello"]
    )
    allowed = [bad[0][-1], *llm.engine.eos_token_ids]  # a bad word's token, and the EOS min_tokens bans
    params = SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=allowed, **extra)
    out = llm.generate("Hello there", params)[0].outputs[0]
    assert out.token_ids and set(out.token_ids) <= set(allowed), out.token_ids
    with pytest.raises(InvalidParamError, match="missing \\[7\\]") as exc:
        SamplingParams(allowed_token_ids=[3], thinking_token_budget=2, reasoning_end_token_id=3,
                       thinking_budget_message_ids=[7])  # fmt: skip
    assert exc.value.param == "allowed_token_ids"
    llm.engine.check_invariants()


def test_a_choice_or_grammar_its_bans_cut_off_ends(llm: LLM) -> None:
    """A choice whose only path bad words ban, or a finished regex while min_tokens bans EOS: no
    token is valid and the row takes EOS (every logit was -inf and the argmax took token 0, "!"
    in Llama 3's vocabulary), ending the request or, under min_tokens, filling to it."""
    eos = llm.engine.eos_token_ids[0]
    greedy = {"temperature": 0, "max_tokens": 8}
    out = llm.generate("Hello there", SamplingParams(guided_choice=["yes"], bad_words=["yes"], **greedy))
    assert out[0].outputs[0].token_ids == [eos] and out[0].outputs[0].finish_reason == "stop"
    out = llm.generate("Hello there", SamplingParams(guided_regex="ab", min_tokens=5, **greedy))
    ids = out[0].outputs[0].token_ids
    words = [t for t in ids if t != eos]
    assert len(ids) == 5 and ids[len(words) :] == [eos] * (5 - len(words)), ids
    assert llm.engine.tokenizer.decode(words) == "ab" and out[0].outputs[0].finish_reason == "stop"
    llm.engine.check_invariants()


@budget(120, derandomize=False, database=None)
@given(d=st.fixed_dictionaries({}, optional=FIELDS))
def test_any_params_are_refused_naming_a_field_or_served(llm: LLM, d: dict[str, Any]) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = llm.generate("The quick brown fox", greedy)[0].outputs[0].token_ids
    if d.get("max_tokens", 16) > 64:  # keep each example short (the tiny context caps it anyway)
        d["max_tokens"] = 64
    try:
        params = SamplingParams(**d)
        outs = llm.generate("Hello there", params)
    except InvalidParamError as exc:
        assert exc.param in d, (exc.param, str(exc))
        assert str(exc).startswith(exc.param)
    except ValueError as exc:  # every refusal names a field
        pytest.fail(f"refused without a field: {exc!r}")
    else:
        vocab = llm.engine.vocab_size
        encode = functools.partial(llm.engine.tokenizer.encode, add_special_tokens=False)
        for c in outs[0].outputs:
            assert all(0 <= t < vocab for t in c.token_ids)
            if params.allowed_token_ids:  # a whitelist: no other constraint overrides it
                assert set(c.token_ids) <= set(params.allowed_token_ids)
            elif params.guided_choice and not (params.min_tokens or params.bad_words):  # (each may mask all)
                paths = [encode(ch) for ch in params.guided_choice]
                t = list(c.token_ids)
                while t and t[-1] in llm.engine.eos_token_ids:  # EOS after a whole choice (ignore_eos: again)
                    t.pop()
                assert any(p[: len(t)] == t for p in paths), (t, paths)
            elif params.bad_words:  # (with allowed ids every one may be banned)
                t = c.token_ids
                for w in bad_words_token_ids(encode, params.bad_words):
                    assert not any(t[i : i + len(w)] == w for i in range(len(t))), (w, t)
            for step in c.logprobs or []:
                assert all(math.isfinite(lp.logprob) for lp in step.values())
    llm.engine.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0
    assert llm.generate("The quick brown fox", greedy)[0].outputs[0].token_ids == expected
