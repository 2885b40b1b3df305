"""SamplingParams: defaults, normalization and validation (each error names its field)."""

from __future__ import annotations

import pytest

from lorastar.engine.sampling import SamplingParams


def test_defaults_match_design() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 16, 1.0, 1.0, 0, 0.0)
    assert p.seed is None and p.logprobs is None
    assert p.stop == [] and p.stop_token_ids == []
    assert (p.ignore_eos, p.include_stop_str_in_output, p.use_beam_search) == (False, False, False)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.length_penalty, p.skip_special_tokens, p.min_tokens) == (1.0, True, 0)
    assert not p.is_greedy


def test_normalization() -> None:
    p = SamplingParams(stop="###", stop_token_ids=(3, 4), top_k=-1, temperature=0)
    assert p.stop == ["###"]
    assert p.stop_token_ids == [3, 4]
    assert p.top_k == 0
    assert isinstance(p.temperature, float) and p.is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 1.5),
        ("max_tokens", 0),
        ("max_tokens", None),
        ("temperature", -0.1),
        ("temperature", "hot"),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("seed", 1.5),
        ("seed", "42"),
        ("seed", True),
        ("stop", 5),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop_token_ids", 7),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", [-1]),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 2.1),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("logprobs", -2),  # -1: the whole vocabulary (vLLM's), up to the engine's max_logprobs
        ("logprobs", 1.0),
        ("ignore_eos", "yes"),
        ("include_stop_str_in_output", 1),
        ("use_beam_search", None),
        ("skip_special_tokens", "no"),
        ("min_tokens", -1),
        ("length_penalty", "x"),
        # Values the engine process's messages cannot carry (an int64 overflow, a lone surrogate):
        # rejected here, by name, instead of failing the send.
        ("allowed_token_ids", [2**64]),
        ("stop", ["ok\ud800"]),
        ("bad_words", ["\udfff"]),
        ("guided_choice", ["yes", "n\ud800o"]),
    ],
)
def test_invalid_value_names_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_valid_edges() -> None:
    SamplingParams(
        top_p=1.0, min_p=1.0, logprobs=0, temperature=0.0, presence_penalty=-2, frequency_penalty=2
    )
    SamplingParams(logprobs=20, repetition_penalty=1.3, seed=0, top_k=1, min_tokens=16)
    # the most top logprobs is the engine's (EngineConfig.max_logprobs: tests/engine/test_max_logprobs.py)
    SamplingParams(logprobs=100, prompt_logprobs=100)


def test_from_dict() -> None:
    p = SamplingParams.from_dict({"temperature": 0.5, "stop": "x", "top_p": None, "seed": 3})
    assert p.temperature == 0.5 and p.stop == ["x"] and p.top_p == 1.0 and p.seed == 3
    with pytest.raises(ValueError, match="unknown sampling field 'foo'"):
        SamplingParams.from_dict({"temperature": 0.5, "foo": 1})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_dict({"top_p": 2})


def test_clone_is_independent() -> None:
    p = SamplingParams(stop=["a"], stop_token_ids=[1], seed=7)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("b")  # type: ignore[union-attr]
    q.stop_token_ids.append(2)  # type: ignore[union-attr]
    assert p.stop == ["a"] and p.stop_token_ids == [1]
    assert SamplingParams(**p.to_dict()) == p
