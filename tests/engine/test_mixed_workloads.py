"""Every kind of request at once, at random steps, on a cache small enough to preempt: greedy,
seeded and unseeded sampling, ``n > 1``, beam search, penalties, logprobs, prompt logprobs, stop
tokens and strings, ``min_tokens``, ``logit_bias``, guided choices and regexes, aborts, three adapters over two slots, prompts
that share cached blocks; with and without async scheduling, and on a sliding-window model (blocks
left behind the window are freed as sequences grow) with an FP8 KV cache, and drafting ngrams
(speculative decoding).

What must hold whatever the mix (token values are held to HF elsewhere): no step raises, the
engine's invariants hold after every step, each request ends once with ``n`` completions within its
limits, and the engine is left with no request, block, adapter reference or placeholder. Workloads
like these found a livelock (a preempted beam stuck behind a queue head that did not fit, its
siblings waiting for it forever) and ``n > 1`` requests aborted before forking ending with one
completion."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lorastar import LLM, SamplingParams
from lorastar.errors import LimitExceededError
from tests.conftest import make_peft_adapter
from tests.fuzzing import budget


@pytest.fixture(
    scope="module",
    params=[
        ("llama-gqa", False, "auto", None),
        ("llama-gqa", True, "auto", None),
        ("mistral-window", True, "fp8", None),
        # ngram drafts of 1-2-grams: every repeated token drafts (random outputs repeat often)
        (
            "mistral-window",
            False,
            "auto",
            {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
        ),
    ],
    ids=["sync", "async", "window-fp8-async", "window-spec"],
)
def make_engine(tiny_model_dir, tmp_path_factory, request):  # noqa: ANN001, ANN201
    """A fresh engine per example (a failing example then replays the same way), with three
    adapters of different ranks and two device slots."""
    model, async_scheduling, kv_cache_dtype, spec = request.param
    path = tiny_model_dir(model)
    root = tmp_path_factory.mktemp("mixed-adapters")
    adapters = {f"a{k}": make_peft_adapter(path, root / f"a{k}", k, r=4 * (k + 1)) for k in range(3)}

    def make():  # noqa: ANN202
        llm = LLM(path, num_kv_blocks=12, block_size=4, max_num_batched_tokens=24, max_num_seqs=6,
                  max_loras=2, max_lora_rank=16, async_scheduling=async_scheduling,
                  kv_cache_dtype=kv_cache_dtype, speculative_config=spec)  # fmt: skip
        for name, folder in adapters.items():
            llm.load_adapter(name, folder)
        return llm.engine

    return make


@st.composite
def params(draw: st.DrawFn) -> SamplingParams:
    kind = draw(st.sampled_from(["greedy", "sample", "n", "beam", "penalties"]))
    max_tokens = draw(st.integers(1, 12))
    kw: dict = {"max_tokens": max_tokens, "ignore_eos": draw(st.booleans())}
    if kind == "beam":
        return SamplingParams(n=draw(st.integers(1, 3)), use_beam_search=True, temperature=0, **kw)
    kw["temperature"] = 0.0 if kind == "greedy" else 0.8
    if kind != "greedy":
        kw["seed"] = draw(st.one_of(st.none(), st.integers(0, 9)))
        kw["top_p"] = draw(st.sampled_from([1.0, 0.9]))
        kw["top_k"] = draw(st.sampled_from([0, 20]))
    if kind == "n":
        kw["n"] = draw(st.integers(2, 3))
    if kind == "penalties":
        kw.update(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3)
    return SamplingParams(
        logprobs=draw(st.one_of(st.none(), st.integers(0, 3))),
        prompt_logprobs=draw(st.one_of(st.none(), st.integers(0, 2))),
        stop_token_ids=draw(st.one_of(st.none(), st.lists(st.integers(3, 49151), max_size=2))),
        stop=draw(st.one_of(st.none(), st.just(["e"]))),
        min_tokens=draw(st.integers(0, max_tokens)),
        logit_bias=draw(st.one_of(st.none(), st.just({7: 5.0}))),
        allowed_token_ids=draw(st.one_of(st.none(), st.just([5, 7, 9, 11]))),
        bad_words=draw(st.sampled_from([None, None, ["the"], ["a b"]])),  # one token; two (holds sync)
        # a choice, or a grammar (its own matcher per sequence, caught up after preemption)
        **draw(
            st.sampled_from(
                [{}, {}, {}, {"guided_choice": ["yes", "no way"]}, {"guided_regex": "[a-c ]{1,9}"}]
            )
        ),
        cache_salt=draw(st.sampled_from([None, None, "s"])),  # salted prefixes share only with salted
        **kw,
    )


@budget(20)  # x4 engine modes; make fuzz runs LORASTAR_FUZZ times as many
@given(
    reqs=st.lists(
        st.tuples(
            st.one_of(  # prompt: any, or one of a few sharing their first blocks (prefix-cache hits)
                st.lists(st.integers(3, 49151), min_size=1, max_size=20),
                st.sampled_from([(5,) * 9, (5,) * 9 + (6,) * 8, (5,) * 17]).map(list),
            ),
            params(),
            st.integers(0, 4),  # step it arrives at
            st.one_of(st.none(), st.integers(0, 10)),  # step it is aborted at
            st.sampled_from([None, "a0", "a1", "a2"]),  # adapter
        ),
        min_size=1,
        max_size=6,
    )
)
def test_any_mix_of_requests_runs_and_leaks_nothing(make_engine, reqs) -> None:  # noqa: ANN001
    engine = make_engine()
    ids: dict[int, str] = {}
    finals: dict[str, object] = {}
    step = 0
    while step <= 4 or engine.has_unfinished():
        for i, (prompt, sp, arrive, _, adapter) in enumerate(reqs):
            if arrive == step:
                try:
                    ids[i] = engine.add_request(prompt, sp, adapter=adapter).request_id
                except LimitExceededError:  # a beam search that cannot fit this cache: refused whole
                    assert sp.use_beam_search
        for i, (*_, abort, _) in enumerate(reqs):
            if abort == step and i in ids and (out := engine.abort_request(ids[i])) is not None:
                assert out.finished and ids[i] not in finals
                finals[ids[i]] = out
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, "a request ended twice"
                finals[out.request_id] = out
        engine.check_invariants()
        step += 1
        assert step < 400, f"the workload did not drain: {engine.scheduler.all_sequences()}"
    for i, rid in ids.items():
        sp = reqs[i][1]
        out = finals[rid]
        assert len(out.outputs) == sp.n  # type: ignore[attr-defined]
        for c in out.outputs:  # type: ignore[attr-defined]
            assert c.finish_reason in ("stop", "length", "abort")
            assert len(c.token_ids) <= sp.max_tokens
            if c.finish_reason != "abort" and sp.logprobs is not None and not sp.use_beam_search:
                assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    assert not engine.requests and not engine.has_unfinished()
    assert engine.block_manager.num_used_blocks == 0
    assert engine._num_sync_requests == 0
    assert all(a.in_flight == 0 for a in engine.list_adapters())
