"""vLLM's output kinds: DELTA outputs join to exactly the CUMULATIVE output, FINAL_ONLY hands out
one complete output, and AsyncLLM coalesces piled-up deltas without losing any."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from lorastar import AsyncLLM, RequestOutput, RequestOutputKind, SamplingParams
from lorastar.engine.engine import LLMEngine
from lorastar.engine.outputs import CompletionOutput, Logprob, RequestMetrics
from lorastar.engine.streams import merge_deltas
from lorastar.errors import InvalidParamError

KINDS = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY)


def _run(
    engine: LLMEngine, prompt: list[int], params: SamplingParams
) -> dict[RequestOutputKind, list[RequestOutput]]:
    """The same request once per kind, all in one batch; every output each one handed out."""
    rids = {}
    for kind in KINDS:
        p = params.clone()
        p.output_kind = kind
        rids[engine.add_request(prompt, p).request_id] = kind
    got: dict[RequestOutputKind, list[RequestOutput]] = {k: [] for k in KINDS}
    while engine.has_unfinished():
        for out in engine.step():
            got[rids[out.request_id]].append(out)
    engine.check_invariants()
    return got


def _joined(outs: list[RequestOutput]) -> dict[int, tuple[str, list[int], Any, Any]]:
    joined: dict[int, tuple[str, list[int], Any, Any]] = {}
    for out in outs:
        for o in out.outputs:
            text, ids, lps, _ = joined.get(o.index, ("", [], [] if o.logprobs is not None else None, None))
            joined[o.index] = (
                text + o.text,
                ids + o.token_ids,
                None if o.logprobs is None else lps + o.logprobs,
                (o.finish_reason, o.stop_reason, o.cumulative_logprob),
            )
    return joined


def _whole(out: RequestOutput) -> dict[int, tuple[str, list[int], Any, Any]]:
    return {
        o.index: (o.text, o.token_ids, o.logprobs, (o.finish_reason, o.stop_reason, o.cumulative_logprob))
        for o in out.outputs
    }


def _same(
    got: dict[int, tuple[str, list[int], Any, Any]], want: dict[int, tuple[str, list[int], Any, Any]]
) -> None:
    """Texts, ids and finish state exact; logprobs to 1e-4 (the three copies of the request sit in
    different rows of one batch, whose float order differs slightly)."""
    assert got.keys() == want.keys()
    for i in want:
        (t1, ids1, lp1, (f1, s1, c1)), (t2, ids2, lp2, (f2, s2, c2)) = got[i], want[i]
        assert (t1, ids1, f1, s1) == (t2, ids2, f2, s2)
        assert (c1 is None) == (c2 is None) and (c1 is None or c1 == pytest.approx(c2, abs=1e-3))
        assert (lp1 is None) == (lp2 is None)
        for a, b in zip(lp1 or [], lp2 or [], strict=True):
            assert a.keys() == b.keys()
            for t in a:
                assert (a[t].rank, a[t].decoded_token) == (b[t].rank, b[t].decoded_token)
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Any) -> LLMEngine:
    from lorastar.config import EngineConfig

    return LLMEngine(EngineConfig.from_kwargs(model=tiny_model_dir("llama-gqa"), num_kv_blocks=256))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=15, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=2),
    ],
    ids=["greedy-logprobs", "n3-seeded", "prompt-logprobs"],
)
def test_delta_joins_to_cumulative_and_final_only_is_one_output(
    engine: LLMEngine, params: SamplingParams
) -> None:
    got = _run(engine, [7, 8, 9, 10, 11] * 3, params)
    cumulative, delta, final = (
        got[RequestOutputKind.CUMULATIVE],
        got[RequestOutputKind.DELTA],
        got[RequestOutputKind.FINAL_ONLY],
    )
    assert len(cumulative) > 1 and len(delta) == len(cumulative)  # one output per step each
    assert len(final) == 1 and final[0].finished
    want = _whole(cumulative[-1])
    _same(_joined(delta), want)
    _same(_whole(final[0]), want)
    # Deltas carry each token once: no output repeats an earlier one's tokens.
    assert sum(len(o.token_ids) for out in delta for o in out.outputs) == sum(
        len(v[1]) for v in want.values()
    )
    if params.prompt_logprobs is not None:
        assert len(delta[0].prompt_logprobs or []) == len(cumulative[-1].prompt_logprobs or []) > 1
        assert final[0].prompt_logprobs is not None
        assert delta[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in delta[1:])


def test_delta_never_hands_out_a_partial_stop_string(engine: LLMEngine) -> None:
    """A stop string found mid-stream: the deltas join to the cut text (held-back text that turned
    out to be the stop string was never handed out)."""
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    text = _run(engine, [3, 4, 5, 6], base)[RequestOutputKind.CUMULATIVE][-1].outputs[0].text
    assert len(text) > 12
    stop = text[8:12]
    got = _run(
        engine, [3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    )
    want = _whole(got[RequestOutputKind.CUMULATIVE][-1])
    assert stop not in want[0][0] and want[0][3][0] == "stop"
    _same(_joined(got[RequestOutputKind.DELTA]), want)
    _same(_whole(got[RequestOutputKind.FINAL_ONLY][0]), want)


def test_beam_search_with_delta_hands_out_only_its_final_hypotheses(engine: LLMEngine) -> None:
    got = _run(engine, [9, 9, 2, 5], SamplingParams(n=2, use_beam_search=True, max_tokens=6, temperature=0))
    assert len(got[RequestOutputKind.DELTA]) == 1
    _same(_whole(got[RequestOutputKind.DELTA][0]), _whole(got[RequestOutputKind.CUMULATIVE][-1]))


def test_output_kind_is_validated() -> None:
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA  # type: ignore[arg-type]
    with pytest.raises(InvalidParamError) as e:
        SamplingParams(output_kind=7)  # type: ignore[arg-type]
    assert e.value.param == "output_kind"


def test_merge_deltas_joins_choices_in_order() -> None:
    a = RequestOutput(
        "r",
        None,
        [1],
        [CompletionOutput(0, "ab", [1, 2], None, [{}, {}]), CompletionOutput(1, "x", [5])],
        False,
    )
    b = RequestOutput(
        "r",
        None,
        [1],
        [CompletionOutput(1, "y", [6], finish_reason="length"), CompletionOutput(0, "c", [3], -1.0, [{}])],
        True,
    )
    m = merge_deltas(a, b)
    assert m.finished and [o.index for o in m.outputs] == [0, 1]
    assert (m.outputs[0].text, m.outputs[0].token_ids, len(m.outputs[0].logprobs or [])) == (
        "abc",
        [1, 2, 3],
        3,
    )
    assert (m.outputs[1].text, m.outputs[1].token_ids, m.outputs[1].finish_reason) == ("xy", [5, 6], "length")


def test_merge_deltas_keeps_every_field() -> None:
    """Every field of both shapes is set to a value of its own: the merge keeps the newer output's
    (the joined fields aside), so a field added to either shape and not carried over fails here."""
    metrics = RequestMetrics(1.0, 2.0, 3.0, 4.0, 5.0)
    lp_a, lp_b = [{7: Logprob(-0.5, 1, "a")}], [{8: Logprob(-0.25, 2, "b")}]
    a = RequestOutput("r", "p", [1, 2], [CompletionOutput(0, "x", [7], -0.5, lp_a)], False, "ad", 3,
                      [None, {2: Logprob(-1.0)}], RequestMetrics(0.5))  # fmt: skip
    new = CompletionOutput(0, "y", [8], -0.75, lp_b, "stop", "</s>")
    b = RequestOutput("r", "p", [1, 2], [new], True, "ad", 4, None, metrics, [0.5, -0.25])
    m = merge_deltas(a, b)
    joined = {"text": "xy", "token_ids": [7, 8], "logprobs": lp_a + lp_b}
    for f in dataclasses.fields(CompletionOutput):
        assert getattr(m.outputs[0], f.name) == joined.get(f.name, getattr(new, f.name)), f.name
    for f in dataclasses.fields(RequestOutput):
        want = {"outputs": m.outputs, "prompt_logprobs": a.prompt_logprobs}.get(f.name, getattr(b, f.name))
        assert getattr(m, f.name) == want, f.name
    # a new field: give it a value above and carry it in merge_deltas, then count it here
    assert len(dataclasses.fields(CompletionOutput)) == 7 and len(dataclasses.fields(RequestOutput)) == 10


async def test_async_delta_stream_with_a_slow_reader_loses_nothing(tiny_model_dir: Any) -> None:
    """A reader slower than the engine gets coalesced deltas: fewer outputs, same joined text."""
    path = tiny_model_dir("llama-gqa")
    llm = AsyncLLM(model=path, num_kv_blocks=128)
    await llm.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
        cumulative = [o async for o in llm.generate([4, 5, 6], params)][-1]
        delta_params = params.clone()
        delta_params.output_kind = RequestOutputKind.DELTA
        outs = []
        async for o in llm.generate([4, 5, 6], delta_params):
            outs.append(o)
            await asyncio.sleep(0.05)  # the engine runs ahead: deltas pile up in the queue
        assert outs[-1].finished and len(outs) < 40
        _same(_joined(outs), _whole(cumulative))
    finally:
        await llm.shutdown()
