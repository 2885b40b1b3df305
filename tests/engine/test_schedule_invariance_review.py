"""Scheduling never changes what a request outputs: one batch of requests (greedy, seeded, n > 1,
penalties, logprobs, prompt logprobs, stop tokens, adapters, a shared prefix, prompts longer than
the token budget) gives the same completions on a roomy engine and on tight ones (chunked
prefills, preemption by recompute, few seats, one adapter slot, prefix caching off, async
scheduling), aborting one request mid-way leaves the others' outputs alone, and every run leaves
no request, block or adapter reference behind. A beam search that can only finish while its
beams share their prompt blocks is refused up front when preemption can't give them back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lorastar import LLM, SamplingParams
from lorastar.engine.engine import LLMEngine
from lorastar.engine.request import SeqStatus
from lorastar.errors import LimitExceededError
from tests.conftest import make_peft_adapter

_SHARED = [(7 * i + 11) % 1900 + 3 for i in range(13)]
_ROOMY: dict[str, Any] = dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=512, max_num_seqs=32)
_TIGHT: dict[str, Any] = dict(
    num_kv_blocks=14, block_size=4, max_num_batched_tokens=16, max_num_seqs=3, max_loras=1
)
_CONFIGS: dict[str, dict[str, Any]] = {
    "tight": _TIGHT,
    "tight-no-prefix-cache": {**_TIGHT, "enable_prefix_caching": False},
    "tight-chunk7-async": {
        **_TIGHT,
        "num_kv_blocks": 15,
        "max_num_batched_tokens": 7,
        "max_num_seqs": 4,
        "max_loras": 2,
        "async_scheduling": True,
    },  # fmt: skip
}


def _prompt(n: int, k: int) -> list[int]:
    return [(31 * i + 17 * k) % 1990 + 3 for i in range(n)]


# (prompt, params, adapter): every request fits the tight cache (14 blocks of 4) alone.
_REQS: list[tuple[list[int], SamplingParams, str | None]] = [
    (
        _SHARED + _prompt(21, 0),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2),
        None,
    ),
    (
        _prompt(26, 1),
        SamplingParams(temperature=0.9, seed=5, max_tokens=10, ignore_eos=True, logprobs=1),
        "a0",
    ),
    (
        _SHARED + _prompt(4, 2),
        SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=6, ignore_eos=True),
        "a1",
    ),
    (
        _prompt(9, 3),
        SamplingParams(
            temperature=0,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            max_tokens=7,
            ignore_eos=True,
            prompt_logprobs=1,
        ),
        None,
    ),  # fmt: skip
    (
        _SHARED + _prompt(21, 0),
        SamplingParams(temperature=0.7, seed=3, top_k=20, max_tokens=12, ignore_eos=True, logprobs=0),
        "a0",
    ),  # fmt: skip
    (_prompt(3, 5), SamplingParams(temperature=0, n=2, max_tokens=5, ignore_eos=True), "a1"),
]


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory) -> tuple[str, dict[str, str]]:  # noqa: ANN001
    path = tiny_model_dir("llama-gqa")
    root = tmp_path_factory.mktemp("invariance-adapters")
    return path, {f"a{k}": make_peft_adapter(path, Path(root) / f"a{k}", k, r=4 * (k + 1)) for k in range(2)}


def _engine(model: tuple[str, dict[str, str]], cfg: dict[str, Any]) -> LLMEngine:
    path, adapters = model
    llm = LLM(path, max_model_len=128, max_lora_rank=8, **cfg)
    for name, folder in adapters.items():
        llm.load_adapter(name, folder)
    return llm.engine


def _run(
    engine: LLMEngine,
    reqs: list[tuple[list[int], SamplingParams, str | None]],
    abort: tuple[int, int, str] | None = None,
) -> list[Any]:
    """Each request's completions (staggered arrivals); ``abort``: (request, step) to abort at, and
    the state it must be in then ("preempted" or "chunked": part of its prompt computed)."""
    ids: list[str] = []
    finals: dict[str, Any] = {}
    step = 0
    while step <= len(reqs) or engine.has_unfinished():
        if step < len(reqs):  # one arrival a step: some join mid-prefill / mid-decode of others
            prompt, sp, adapter = reqs[step]
            ids.append(engine.add_request(prompt, sp, adapter=adapter).request_id)
        if abort is not None and step == abort[1]:
            seq = engine.requests[ids[abort[0]]].sequences[0]
            if abort[2] == "preempted":
                assert seq.status is SeqStatus.WAITING and seq.num_preemptions > 0
            else:
                assert seq.status is SeqStatus.RUNNING and 0 < seq.num_computed_tokens < seq.num_prompt_tokens
            out = engine.abort_request(ids[abort[0]])
            assert out is not None and out.finished
            finals[out.request_id] = out
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, "a request ended twice"
                finals[out.request_id] = out
        engine.check_invariants()
        step += 1
        assert step < 300, f"the engine did not drain: {engine.scheduler.all_sequences()}"
    # Nothing left behind: requests, blocks, adapter references, sync holds.
    assert not engine.requests and not engine.scheduler.has_work()
    assert engine.block_manager.num_used_blocks == 0
    assert engine._num_sync_requests == 0
    assert all(a.in_flight == 0 for a in engine.list_adapters())
    return [finals[rid] for rid in ids]


def _same(a: Any, b: Any, *, tol: float = 2e-3) -> None:
    """Same completions; logprobs within ``tol`` (ranks deep in a near-flat random distribution
    can swap by one on float noise: only the top ranks are compared)."""
    assert len(a.outputs) == len(b.outputs)
    for ca, cb in zip(a.outputs, b.outputs):
        assert (ca.index, list(ca.token_ids), ca.finish_reason) == (
            cb.index,
            list(cb.token_ids),
            cb.finish_reason,
        )
        assert (ca.cumulative_logprob is None) == (cb.cumulative_logprob is None)
        if ca.cumulative_logprob is not None:
            assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=10 * tol)
        _same_logprobs(ca.logprobs, cb.logprobs, tol)
    _same_logprobs(a.prompt_logprobs, b.prompt_logprobs, tol)


def _same_logprobs(a: Any, b: Any, tol: float) -> None:
    assert (a is None) == (b is None)
    if a is None:
        return
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is None:
            continue
        assert set(x) == set(y)
        for tok in x:
            assert x[tok].logprob == pytest.approx(y[tok].logprob, abs=tol)
            if min(x[tok].rank, y[tok].rank) <= 5:
                assert x[tok].rank == y[tok].rank


@pytest.fixture(scope="module")
def reference(model) -> list[Any]:  # noqa: ANN001
    return _run(_engine(model, _ROOMY), _REQS)


@pytest.mark.parametrize("name", list(_CONFIGS))
def test_outputs_do_not_depend_on_the_schedule(model, reference, name: str) -> None:  # noqa: ANN001
    engine = _engine(model, _CONFIGS[name])
    outs = _run(engine, _REQS)
    if name.startswith("tight"):  # the tight configs do exercise preemption
        assert engine.scheduler.stats.num_preemptions > 0
    for ref, out in zip(reference, outs):
        _same(ref, out)


@pytest.mark.parametrize(
    ("config", "victim", "step", "state"),
    [("tight", 1, 5, "preempted"), ("tight-chunk7-async", 1, 10, "preempted"),
     ("tight-chunk7-async", 4, 26, "chunked")],
)  # fmt: skip
def test_abort_mid_prefill_or_preempted_leaves_others_alone(
    model,
    reference,
    config: str,
    victim: int,
    step: int,
    state: str,  # noqa: ANN001
) -> None:
    outs = _run(_engine(model, _CONFIGS[config]), _REQS, abort=(victim, step, state))
    for i, (ref, out) in enumerate(zip(reference, outs)):
        if i != victim:
            _same(ref, out)


def _drain(engine: Any, late: tuple[list[int], SamplingParams]) -> None:
    """Step ``engine`` until it is idle, adding ``late`` at step 3 (it competes for the blocks)."""
    steps = 0
    while engine.has_unfinished():
        if steps == 3:
            engine.add_request(*late)
        engine.step()
        steps += 1
        assert steps < 200, "the engine livelocked"


def test_beam_search_without_prefix_cache_never_livelocks(model) -> None:  # noqa: ANN001
    """Without the prefix cache a preempted beam recomputes its prompt into blocks of its own: a
    beam search whose beams only fit while sharing their prompt blocks used to pass the admission
    check and then preempt itself forever (the engine spun, no request ever finished). It is
    refused up front now; with the prefix cache the same request runs to the end."""
    beam = SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=11, ignore_eos=True)
    other = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cfg: dict[str, Any] = dict(num_kv_blocks=14, block_size=4, max_num_batched_tokens=16, max_num_seqs=3)
    # 25 + 11 tokens = 9 blocks a beam: 6 prompt blocks shared -> 12 blocks, unshared -> 18 (> 14)
    prompt = _prompt(25, 9)
    engine = _engine(model, {**cfg, "enable_prefix_caching": False})
    with pytest.raises(LimitExceededError):
        engine.add_request(prompt, beam)
    assert not engine.requests and engine.block_manager.num_used_blocks == 0
    engine.add_request(prompt[:17], beam)  # 7 blocks a beam, unshared: 14 fit, even preempted
    _drain(engine, late=(_prompt(20, 10), other))
    assert engine.block_manager.num_used_blocks == 0
    # With the prefix cache a preempted beam takes the shared prompt blocks back: it fits and ends.
    engine = _engine(model, cfg)
    engine.add_request(prompt, beam)
    _drain(engine, late=(_prompt(20, 10), other))
    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.block_manager.num_used_blocks == 0
