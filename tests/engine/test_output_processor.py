"""The frontend's output processor alone: core deltas in, RequestOutputs out (torch-free; the
embedded SmolLM2 tokenizer). The end-to-end checks (the engine in-process and as a core process
against HF and each other) are in test_llm.py / test_core_process.py."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from lorastar.engine.output_processor import OutputProcessor
from lorastar.engine.outputs import EngineCoreOutput, SampleDelta
from lorastar.engine.sampling import RequestOutputKind, SamplingParams
from lorastar.models.default import default_model_dir


@pytest.fixture(scope="module")
def tok():  # noqa: ANN201
    return AutoTokenizer.from_pretrained(default_model_dir())


def _ids(tok, text: str) -> list[int]:  # noqa: ANN001
    return tok(text, add_special_tokens=False)["input_ids"]


def _proc(tok, params: SamplingParams, prompt: str = "Say:") -> OutputProcessor:  # noqa: ANN001
    proc = OutputProcessor(tok)
    proc.add_request("r", prompt, _ids(tok, prompt), params, adapter="a")
    return proc


def _step(proc: OutputProcessor, *samples: SampleDelta, finished: bool = False):  # noqa: ANN202
    return proc.process([EngineCoreOutput("r", list(samples), finished=finished, num_cached_tokens=3)])


def test_stop_string_across_tokens_in_one_delta_finishes_here(tok) -> None:  # noqa: ANN001
    """Several tokens in one delta (speculative decoding's shape): the text is cut at the stop
    string, later tokens of the delta are dropped, the sample is reported to the core, and the
    core's further outputs for it are ignored."""
    ids = _ids(tok, " hello world, and more")
    proc = _proc(tok, SamplingParams(max_tokens=50, stop=["world"]))
    outs, stops = _step(proc, SampleDelta(0, ids))
    assert stops == [("r", 0, "world")]
    (out,) = outs
    assert out.finished and out.outputs[0].text == " hello "
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "world"
    assert out.outputs[0].token_ids == ids[: len(out.outputs[0].token_ids)] and len(
        out.outputs[0].token_ids
    ) < len(ids)
    assert out.prompt == "Say:" and out.adapter == "a" and out.num_cached_tokens == 3
    assert _step(proc, SampleDelta(0, ids[:1])) == ([], [])  # late core output: ignored
    assert not proc.requests


def test_precedence_eos_and_stop_tokens_before_stop_strings_before_length(tok) -> None:  # noqa: ANN001
    ids = _ids(tok, " the end")
    # The core ended the sample on this token for EOS / a stop token id: its reason stands, and its
    # text is left out unless include_stop_str_in_output (vLLM v1's detokenizer; the id stays).
    for include, text in ((False, " the"), (True, " the end")):
        proc = _proc(tok, SamplingParams(max_tokens=50, stop=["end"], include_stop_str_in_output=include))
        outs, stops = _step(proc, SampleDelta(0, ids, finish_reason="stop", stop_reason=ids[-1]))
        o = outs[0].outputs[0]
        assert stops == [] and (o.stop_reason, o.text, o.token_ids) == (ids[-1], text, ids)
    # The core ended it on length: a stop string in the same token comes first.
    proc = _proc(tok, SamplingParams(max_tokens=len(ids), stop=["end"]))
    outs, stops = _step(proc, SampleDelta(0, ids, finish_reason="length"), finished=True)
    o = outs[0].outputs[0]
    assert stops == [("r", 0, "end")] and (o.finish_reason, o.stop_reason, o.text) == ("stop", "end", " the ")


def test_an_eos_kept_as_a_special_token_is_no_text(tok) -> None:  # noqa: ANN001
    """With skip_special_tokens=False (tool-call parsing keeps control tokens) the EOS that ended a
    sample is still no text, as in vLLM; include_stop_str_in_output shows it."""
    ids = [*_ids(tok, " done"), tok.eos_token_id]
    for include, tail in ((False, ""), (True, tok.eos_token)):
        proc = _proc(
            tok, SamplingParams(max_tokens=50, skip_special_tokens=False, include_stop_str_in_output=include)
        )
        (out,), _ = _step(proc, SampleDelta(0, ids, finish_reason="stop"), finished=True)
        assert out.outputs[0].text == " done" + tail and out.outputs[0].token_ids == ids


def test_min_tokens_defers_stop_strings(tok) -> None:  # noqa: ANN001
    ids = _ids(tok, " stop here stop")
    assert len(ids) == 3
    # vLLM's rule: stop strings count from output token min_tokens + 1 (the first EOS may be).
    proc = _proc(tok, SamplingParams(max_tokens=50, stop=["stop"], min_tokens=len(ids) - 1))
    outs, stops = _step(proc, SampleDelta(0, ids))
    assert stops == [("r", 0, "stop")]
    assert outs[0].outputs[0].text == " stop here "  # the first match in the new text window
    proc = _proc(tok, SamplingParams(max_tokens=50, stop=["stop"], min_tokens=len(ids)))
    outs, stops = _step(proc, SampleDelta(0, ids))  # a stop string ending in token min_tokens: text
    assert stops == [] and outs[0].outputs[0].text == " stop here stop" and not outs[0].finished


def test_stream_sends_each_finished_sample_once(tok) -> None:  # noqa: ANN001
    """n > 1, DELTA: a sample finished by a stop string (here) or by the core (EOS, stop token,
    length) is not repeated in later outputs: a stream gets one finishing chunk per choice."""
    a, b, c = _ids(tok, " red fox"), _ids(tok, " blue cat runs"), _ids(tok, " green owl flies far")
    params = SamplingParams(n=3, max_tokens=50, stop=["fox"], output_kind=RequestOutputKind.DELTA)
    proc = _proc(tok, params)
    finishes: dict[int, int] = {}
    steps = [
        (SampleDelta(0, a), SampleDelta(1, b[:1]), SampleDelta(2, c[:1])),  # 0: stop string here
        (SampleDelta(0, [9]), SampleDelta(1, b[1:2], finish_reason="stop"), SampleDelta(2, c[1:2])),
        (SampleDelta(2, c[2:3]),),
        (SampleDelta(2, c[3:], finish_reason="length"),),
    ]
    texts: dict[int, str] = {}
    for i, step in enumerate(steps):
        outs, _ = _step(proc, *step, finished=i == len(steps) - 1)
        for o in outs[0].outputs:
            texts[o.index] = texts.get(o.index, "") + o.text
            if o.finish_reason is not None:
                finishes[o.index] = finishes.get(o.index, 0) + 1
    assert outs[0].finished
    assert finishes == {0: 1, 1: 1, 2: 1}
    assert texts == {0: " red ", 1: tok.decode(b[:1]), 2: tok.decode(c)}


def test_delta_stream_holds_back_a_partial_stop_and_joins_to_the_final_text(tok) -> None:  # noqa: ANN001
    ids = _ids(tok, " one two three four")
    proc = _proc(
        tok, SamplingParams(max_tokens=50, stop=["three four!"], output_kind=RequestOutputKind.DELTA)
    )
    texts, token_ids = [], []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        outs, _ = _step(proc, SampleDelta(0, [t], finish_reason="length" if last else None), finished=last)
        texts.append(outs[0].outputs[0].text)
        token_ids += outs[0].outputs[0].token_ids
        if not last:  # "three four" could still become the stop string: held back
            assert "".join(texts) in " one two "
    assert "".join(texts) == " one two three four" and token_ids == ids


def test_n_samples_finish_separately_and_output_kinds(tok) -> None:  # noqa: ANN001
    a, b = _ids(tok, " red fox"), _ids(tok, " blue cat")
    for kind in RequestOutputKind:
        proc = _proc(tok, SamplingParams(n=2, max_tokens=50, stop=["fox"], output_kind=kind))
        outs, stops = _step(proc, SampleDelta(0, a), SampleDelta(1, b[:1]))
        assert stops == [("r", 0, "fox")]
        if kind == RequestOutputKind.FINAL_ONLY:
            assert outs == []
        else:
            assert not outs[0].finished and [o.finish_reason for o in outs[0].outputs] == ["stop", None]
        outs, stops = _step(
            proc, SampleDelta(0, []), SampleDelta(1, b[1:], finish_reason="length"), finished=True
        )
        (out,) = outs
        delta = kind == RequestOutputKind.DELTA
        # A stream sent sample 0's finish with its stop: it is not sent again (one finishing chunk
        # per choice, as vLLM's n > 1 children); the other kinds carry every sample.
        assert out.finished and [o.index for o in out.outputs] == ([1] if delta else [0, 1])
        want_b = b[1:] if delta else b
        assert out.outputs[-1].token_ids == want_b
        assert out.outputs[-1].text == tok.decode(want_b) and out.outputs[-1].finish_reason == "length"
        if not delta:
            assert out.outputs[0].text == " red "


def test_logprobs_are_named_and_summed(tok) -> None:  # noqa: ANN001
    ids = _ids(tok, " yes no")
    proc = _proc(tok, SamplingParams(max_tokens=50, logprobs=1))
    lps = [[(ids[0], -0.5, 1)], [(7, -0.1, 1), (ids[1], -2.0, 3)]]
    outs, _ = _step(proc, SampleDelta(0, ids, lps))
    o = outs[0].outputs[0]
    assert o.cumulative_logprob == pytest.approx(-2.5)
    assert o.logprobs is not None and o.logprobs[1][ids[1]].rank == 3
    assert o.logprobs[0][ids[0]].decoded_token == tok.decode([ids[0]])


def test_prompt_logprobs_arrive_raw_and_are_named_here(tok) -> None:  # noqa: ANN001
    """The core sends prompt logprobs as (token, logprob, rank) with the prompt token first; the
    frontend names them, the prompt token's entry keeping its place and logprob and taking its
    top-k entry's lower rank (vLLM's: under a tie at the top the token is rank 1), and a DELTA
    stream carries them on its first output only."""
    prompt = _ids(tok, "Say:")
    proc = _proc(tok, SamplingParams(max_tokens=50, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA))
    raw = [None] + [[(t, -1.0 - i, 2), (t, -0.5, 1)] for i, t in enumerate(prompt[1:])]
    outs, _ = proc.process([EngineCoreOutput("r", [SampleDelta(0, [5])], prompt_logprobs=raw)])
    pl = outs[0].prompt_logprobs
    assert pl is not None and pl[0] is None and len(pl) == len(prompt)
    for i, (t, entry) in enumerate(zip(prompt[1:], pl[1:])):
        assert entry is not None and list(entry) == [t]
        assert (
            entry[t].logprob == -1.0 - i and entry[t].rank == 1 and entry[t].decoded_token == tok.decode([t])
        )
    outs, _ = proc.process([EngineCoreOutput("r", [SampleDelta(0, [6])])])
    assert outs[0].prompt_logprobs is None


def test_core_steps_decode_no_text(tiny_model_dir) -> None:  # noqa: ANN001
    """The core's step needs no tokenizer: with logprobs and prompt logprobs asked for, a step of
    the core decodes nothing (names and text are the frontend's)."""
    from lorastar import LLM

    llm = LLM(tiny_model_dir("llama-gqa"), device="cpu", dtype="float32", num_kv_blocks=64)
    eng = llm.engine
    eng.add_request([5, 6, 7, 8], SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=2))

    def refuse(*a: object, **k: object) -> str:
        raise AssertionError("the core decoded text")

    eng.tokenizer.decode = refuse
    got = []
    while eng.has_unfinished():
        got += eng.step_core()
    assert got[0].prompt_logprobs is not None and len(got[0].prompt_logprobs) == 4
    assert got[-1].finished and sum(len(o.samples[0].token_ids) for o in got) == 3


def test_beam_hypotheses_are_decoded_whole(tok) -> None:  # noqa: ANN001
    h0, h1 = _ids(tok, " a tree"), _ids(tok, " the sea")
    proc = _proc(tok, SamplingParams(n=2, use_beam_search=True, max_tokens=8))
    co = EngineCoreOutput(
        "r",
        # a "stop" hypothesis ends on its EOS (the engine's), whose text is left out
        [
            SampleDelta(0, h0, None, -1.0, "length"),
            SampleDelta(1, [*h1, tok.eos_token_id], None, -2.0, "stop"),
        ],
        finished=True,
        whole=True,
    )
    (out,), stops = proc.process([co])
    assert stops == [] and out.finished
    assert [(o.text, o.cumulative_logprob, o.finish_reason) for o in out.outputs] == [
        (" a tree", -1.0, "length"), (" the sea", -2.0, "stop"),
    ]  # fmt: skip


def test_requests_added_while_another_thread_steps_lose_no_output(tiny_model_dir) -> None:  # noqa: ANN001
    """AsyncLLM's shape: requests are added from one thread while another steps the engine. A
    request must be known to the output processor before a step can run it: each of 300 one-token
    requests gets exactly one finished output (before the fix, some finished in the core before
    the processor registered them, and their streams waited forever)."""
    import threading
    import time

    from lorastar import LLM

    eng = LLM(tiny_model_dir("llama-gqa"), num_kv_blocks=256, max_num_seqs=64).engine
    finished: dict[str, int] = {}
    stop = threading.Event()

    def stepper() -> None:
        while not stop.is_set():
            for out in eng.step():
                if out.finished:
                    finished[out.request_id] = finished.get(out.request_id, 0) + 1

    t = threading.Thread(target=stepper)
    t.start()
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        rids = [eng.add_request([5 + i % 40, 6, 7], sp).request_id for i in range(300)]
        deadline = time.monotonic() + 20  # a lost output never comes: the deadline ends the wait
        while len(finished) < len(rids) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        t.join()
    assert [rid for rid in rids if finished.get(rid) != 1] == []
    assert not eng.output_processor.requests and not eng.requests
