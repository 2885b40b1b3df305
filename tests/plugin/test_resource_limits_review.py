"""Pathological but valid-looking inputs (review, round 2): long stop strings streamed to many
samples must not slow every step for everyone, and a lone surrogate in a prompt given through the
Python API is refused naming the field (not a tokenizer ``TypeError``)."""

from __future__ import annotations

import random
import string
from pathlib import Path
from typing import Any

import pytest

from lorastar.engine import output_processor
from lorastar.engine.detokenizer import hold_back
from lorastar.engine.output_processor import OutputProcessor
from lorastar.engine.outputs import EngineCoreOutput, SampleDelta
from lorastar.engine.sampling import RequestOutputKind, SamplingParams
from lorastar.errors import InvalidParamError


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _stops(length: int, rnd: random.Random) -> list[str]:
    return ["".join(rnd.choice(string.ascii_letters) for _ in range(length)) for _ in range(64)]


class _Counted(str):
    """A text that counts the suffix comparisons made on it (the partial-stop check's work)."""

    calls = 0

    def endswith(self, *args: Any) -> bool:  # type: ignore[override]
        _Counted.calls += 1
        return super().endswith(*args)


def _stream(
    tok: Any, stops: list[str], n: int, steps: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, list[tuple[str, str]]]:
    """The suffix comparisons an output processor makes to stream ``steps`` one-token steps of ``n``
    samples with ``stops`` (counted, not timed), and each sample's (streamed text, its tokens' text)."""
    ids = tok(" the quick brown fox jumps over a lazy dog", add_special_tokens=False)["input_ids"]
    proc = OutputProcessor(tok)
    params = SamplingParams(n=n, max_tokens=steps + 1, stop=stops, output_kind=RequestOutputKind.DELTA)
    proc.add_request("r", "hi", [1], params)
    texts: list[str] = [""] * n
    sent: list[list[int]] = [[] for _ in range(n)]
    monkeypatch.setattr(
        output_processor, "hold_back", lambda text, stops, *state: hold_back(_Counted(text), stops, *state)
    )
    _Counted.calls = 0
    for step in range(steps):
        deltas = [SampleDelta(i, [ids[(step + i) % len(ids)]]) for i in range(n)]
        outs, _ = proc.process([EngineCoreOutput("r", deltas)])
        for o in outs[0].outputs:
            texts[o.index] += o.text
            sent[o.index] += o.token_ids
    return _Counted.calls, [(t, tok.decode(s)) for t, s in zip(texts, sent, strict=True)]


def test_long_stop_strings_do_not_stall_the_step_loop(tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """64 stop strings of 256 characters (the limits) on a streamed n=16 request: each step's partial
    stop check was quadratic in the stops' length (~3 ms a sample, ~0.2 s a step at n=128, for every
    request of the server); now it costs the new characters, as with short stops (the comparisons
    are counted: about 30x more for the long stops before)."""
    rnd = random.Random(0)
    short, _ = _stream(tok, _stops(8, rnd), 16, 120, monkeypatch)
    long, texts = _stream(tok, _stops(256, rnd), 16, 120, monkeypatch)
    assert 0 < long < 2 * short, (long, short)
    # nothing matched: all the text went out but what could start a stop string (a few characters)
    assert all(whole.startswith(t) and len(t) > len(whole) - 8 for t, whole in texts), texts[:2]


def test_hold_back_with_its_memo_matches_a_fresh_scan() -> None:
    """The memo (``state``) gives the same answer as a scan from scratch, as the text grows by any
    number of characters, on texts built to keep long partial matches alive and then break them."""
    rnd = random.Random(1)
    for _ in range(200):
        alphabet = rnd.choice(["ab", "abc", "a "])
        stops = [
            "".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 12))) for _ in range(rnd.randint(1, 4))
        ]
        state: list[int] = []
        text = ""
        for _ in range(30):
            text += "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 3)))
            assert hold_back(text, stops, state) == hold_back(text, stops), (text, stops)
        # a shorter text (never the case for one sample, but safe): scanned from scratch
        assert hold_back(text[:3], stops, state) == hold_back(text[:3], stops)


def test_a_lone_surrogate_in_a_prompt_is_refused_naming_the_field(offline_llm: Any) -> None:
    """Python strings may hold lone surrogates (a file read with errors="surrogateescape"); the
    tokenizer raised ``TypeError: TextEncodeInput must be Union[...]``. Now an ``InvalidParamError``
    naming ``prompt`` / ``messages``, as every other invalid input, and the engine serves on."""
    with pytest.raises(InvalidParamError) as err:
        offline_llm.generate(["hi \udcff there"], SamplingParams(max_tokens=2))
    assert err.value.param == "prompt" and "surrogate" in str(err.value)
    with pytest.raises(InvalidParamError) as err:
        offline_llm.chat([{"role": "user", "content": "hi \ud800"}], SamplingParams(max_tokens=2))
    assert err.value.param == "messages"
    with pytest.raises(InvalidParamError) as err:
        offline_llm.engine.tokenize("\udc80")
    assert err.value.param == "prompt"
    (out,) = offline_llm.generate(["hi there"], SamplingParams(max_tokens=2))
    assert len(out.outputs[0].token_ids) == 2
    assert offline_llm.kv_cache_usage()["num_used_blocks"] == 0
