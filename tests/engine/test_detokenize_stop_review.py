"""Review of incremental detokenization and stop strings against a full ``decode`` of the output ids
and vLLM's stop-string rules, driven without a model: token ids straight into the OutputProcessor
(the embedded SmolLM2 tokenizer, byte-level BPE: an emoji is several tokens)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from lorastar.engine.output_processor import OutputProcessor
from lorastar.engine.outputs import CompletionOutput, EngineCoreOutput, SampleDelta
from lorastar.engine.sampling import RequestOutputKind, SamplingParams
from lorastar.models.default import default_model_dir

_EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def tok() -> Any:
    return AutoTokenizer.from_pretrained(default_model_dir())


class _DecodeOnly:
    """A tokenizer with ``decode`` alone: the detokenizer's Python windowed-decode path."""

    def __init__(self, t: Any) -> None:
        self.decode = t.decode


def _ids(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _run(
    tokenizer: Any,
    ids: list[int],
    steps: list[int],
    params: dict[str, Any],
    kind: RequestOutputKind,
    end: str = "length",
) -> tuple[list[CompletionOutput], list[tuple[str, int, str]]]:
    """Feed ``ids`` in steps of ``steps`` tokens (the last step ends the sample with ``end``, and
    for "stop" its last id is the EOS); every CompletionOutput handed out, and the stops reported."""
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1, 17, 42], SamplingParams(**params, logprobs=0, output_kind=kind))
    outs: list[CompletionOutput] = []
    stops: list[tuple[str, int, str]] = []
    pos = 0
    for n in steps:
        chunk, pos = ids[pos : pos + n], pos + n
        fin = pos >= len(ids)
        delta = SampleDelta(
            0,
            chunk,
            logprobs=[[(t, -1.0, 1)] for t in chunk],
            finish_reason=end if fin else None,
            stop_reason=ids[-1] if fin and end == "stop" else None,
        )
        got, hit = proc.process([EngineCoreOutput("r", [delta])])
        stops += hit
        outs += [o.outputs[0] for o in got]
        if any(o.finished for o in got):
            break
    return outs, stops


# ---------------------------------------------------------------------- a stop string in held-back text


def test_stop_string_in_text_held_back_when_length_ends_it_is_cut(tok: Any) -> None:
    """ "ab 🚀" cut by max_tokens after the token " " + the emoji's first byte: that token's text is
    held back (the character is incomplete) and flushed at the end, where no stop string was looked
    for: the output ended "ab \\ufffd" with the stop " " in it and finish_reason "length". The stop
    string is found there too (before the length limit, as in the token's own text)."""
    ids = _ids(tok, "ab 🚀")[:2]
    assert tok.decode(ids) == "ab \ufffd"
    for tokenizer in (tok, _DecodeOnly(tok)):
        for kind in RequestOutputKind:
            for include, want in ((False, "ab"), (True, "ab ")):
                params = {"max_tokens": 2, "stop": [" "], "include_stop_str_in_output": include}
                outs, stops = _run(tokenizer, ids, [1, 1], params, kind)
                text = "".join(o.text for o in outs) if kind == RequestOutputKind.DELTA else outs[-1].text
                last = outs[-1]
                assert (text, last.finish_reason, last.stop_reason) == (want, "stop", " "), (kind, include)
                assert stops == []  # the core had finished it already (length)


def test_stop_string_in_held_back_text_before_eos_is_cut_and_eos_stays_the_reason(tok: Any) -> None:
    """The same held-back text ended by EOS: the stop string is cut out of it; the EOS that ended
    the sample in the core stays its stop_reason (EOS before stop strings)."""
    ids = [*_ids(tok, "ab 🚀")[:2], _EOS]
    outs, _ = _run(tok, ids, [1, 2], {"max_tokens": 9, "stop": [" "]}, RequestOutputKind.DELTA, end="stop")
    assert "".join(o.text for o in outs) == "ab"
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", _EOS)


def test_stop_string_in_held_back_text_out_with_a_kept_eos_is_cut(tok: Any) -> None:
    """With include_stop_str_in_output and skip_special_tokens=False the EOS's text completes the
    held-back window ("ab \ufffd<|im_end|>"), so it came out with the EOS, past the stop-string
    search too: the output kept the stop " " and all after it."""
    ids = [*_ids(tok, "ab 🚀")[:2], _EOS]
    params = {
        "max_tokens": 9,
        "stop": [" "],
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
    }
    for tokenizer in (tok, _DecodeOnly(tok)):
        outs, _ = _run(tokenizer, ids, [1, 2], params, RequestOutputKind.DELTA, end="stop")
        assert "".join(o.text for o in outs) == "ab "
        assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", _EOS)


def test_held_back_text_within_min_tokens_is_not_searched(tok: Any) -> None:
    """vLLM's min_tokens rule holds for the flushed text too: output token min_tokens + 1 on."""
    ids = _ids(tok, "ab 🚀")[:2]
    params = {"max_tokens": 2, "min_tokens": 2, "stop": [" "]}
    outs, _ = _run(tok, ids, [2], params, RequestOutputKind.FINAL_ONLY)
    assert (outs[-1].text, outs[-1].finish_reason) == ("ab \ufffd", "length")


# ---------------------------------------------------------------------- properties (no model)

_PIECES = ["a", "b", " ", "c\n", "🚀", "日本", "é", "👍🏽", " 世界", "<|im_end|>"]


@st.composite
def _cases(draw: st.DrawFn) -> tuple[str, int, list[int], list[tuple[int, int]], bool, bool, bool, str]:
    text = "".join(draw(st.lists(st.sampled_from(_PIECES), min_size=1, max_size=8)))
    cut = draw(st.integers(1, 40))  # max_tokens: may end inside a character
    steps = draw(st.lists(st.integers(1, 3), min_size=40, max_size=40))
    starts = draw(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 4)), max_size=3))
    skip = draw(st.booleans())
    include = draw(st.booleans())
    slow = draw(st.booleans())
    end = draw(st.sampled_from(["length", "stop"]))
    return text, cut, steps, starts, skip, include, slow, end


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_cases())
def test_every_output_kind_agrees_with_a_full_decode(tok: Any, case: Any) -> None:
    """Random texts (multi-byte characters split across tokens, special tokens), cut anywhere, in
    random multi-token steps, with stop strings taken from the decoded text: the DELTA texts join
    to the FINAL_ONLY text, every CUMULATIVE text is a prefix of it (nothing taken back), ids and
    logprobs line up, and the text is decode(output ids) up to the first stop string (cut before
    it, or after it with include_stop_str_in_output), which it never contains otherwise."""
    text, cut, steps, spans, skip, include, slow, end = case
    ids = _ids(tok, text)[:cut]
    if end == "stop":
        ids = [*ids, _EOS]
    # The text to expect: decode(output ids), the EOS's own text only with include_stop_str_in_output.
    full = tok.decode(ids[:-1] if end == "stop" and not include else ids, skip_special_tokens=skip)
    stops = [full[a : a + n] for a, n in spans if full[a : a + n] and "\ufffd" not in full[a : a + n]]
    params = {"max_tokens": 64, "stop": stops or None, "skip_special_tokens": skip}
    params["include_stop_str_in_output"] = include
    tokenizer = _DecodeOnly(tok) if slow else tok
    res = {k: _run(tokenizer, ids, steps[: len(ids)], params, k, end) for k in RequestOutputKind}
    (last,) = res[RequestOutputKind.FINAL_ONLY][0]
    delta = res[RequestOutputKind.DELTA][0]
    cumulative = res[RequestOutputKind.CUMULATIVE][0]
    assert "".join(o.text for o in delta) == last.text == cumulative[-1].text
    assert [t for o in delta for t in o.token_ids] == last.token_ids == cumulative[-1].token_ids
    assert all(last.text.startswith(o.text) for o in cumulative)
    assert sum(len(o.logprobs or []) for o in delta) == len(last.token_ids) == len(last.logprobs or [])
    assert last.token_ids == ids[: len(last.token_ids)]
    assert {(o.finish_reason, o.stop_reason) for o in (delta[-1], cumulative[-1])} == {
        (last.finish_reason, last.stop_reason)
    }
    if isinstance(last.stop_reason, str):
        assert last.finish_reason == "stop" and last.stop_reason in stops
    else:  # EOS (its id) stays the reason; "length" gives way to a stop string
        assert (last.finish_reason, last.stop_reason) == (end, _EOS if end == "stop" else None)
    if not any(s in full for s in stops):
        assert last.text == full
        return
    # Cut at a stop string: before it, or after it with include_stop_str_in_output.
    hit = [s for s in stops if (last.text.endswith(s) if include else full.startswith(last.text + s))]
    assert hit and full.startswith(last.text)
    body = last.text[: -len(hit[0])] if include else last.text
    assert not any(s in body for s in stops)
