"""A seeded random driver of the in-process engine, looking for leaks and crashes: a tiny model on
a small KV cache (preemption), a small token budget (chunked prefills), prefix caching, three
adapters over two slots, and at random steps: requests of every kind (shared prefixes, n > 1, beam
search, stop strings, min_tokens, logprobs, prompt logprobs, guided choices and JSON, prompts near
max_model_len, refused ones), aborts at any moment (waiting, mid-prefill, preempted, running,
already finished, unknown), adapters unloaded and reloaded (other weights, then back) while
requests use them. After every step the engine's invariants hold; once drained, no block is held
(only the prefix cache's, at refcount 0), no adapter is referenced or pinned to a slot by a request,
no request state is left in the engine, scheduler, runner batch or output processor, and each
greedy request that was not aborted output what it outputs run alone. A failure names its seed;
``LORASTAR_FUZZ=K`` runs K times as many fresh seeds, ``LORASTAR_FUZZ_SEEDS=7337,12`` replays those.
Greedy near-ties (top two raw logprobs within 1e-4, which batch shape breaks either way) are exempt
from the solo-run comparison from the tied position on."""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path
from typing import Any

import pytest

from lorastar import LLM, SamplingParams
from lorastar.engine.engine import LLMEngine
from lorastar.errors import AdapterNotFoundError, InvalidParamError, LimitExceededError
from tests.conftest import make_peft_adapter
from tests.fuzzing import FUZZ

MAX_LEN = 40
_BASE_SEEDS = [0, 1, 3]
_REPLAY = [int(x) for x in os.environ.get("LORASTAR_FUZZ_SEEDS", "").split(",") if x.strip()]
SEEDS = _REPLAY or (_BASE_SEEDS if FUZZ <= 0 else [random.randrange(1 << 30) for _ in range(4 * FUZZ)])
_SHARED = [(7 * i + 11) % 1900 + 3 for i in range(12)]  # three full blocks of 4: prefix-cache hits
_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory) -> tuple[str, dict[str, str]]:  # noqa: ANN001
    """The plugin tests' model (sharp logits: greedy is no near-tie lottery) and four adapter
    folders: a0..a2, and a0x (other weights that replace a0 now and then)."""
    path = tiny_model_dir("llama-plugin")
    root = Path(tmp_path_factory.mktemp("fuzz-adapters"))
    folders = {f"a{k}": make_peft_adapter(path, root / f"a{k}", k, r=4 * (k + 1)) for k in range(3)}
    folders["a0x"] = make_peft_adapter(path, root / "a0x", 7, r=4)
    return path, {k: str(v) for k, v in folders.items()}


def _engine(model: tuple[str, dict[str, str]], **kw: Any) -> LLMEngine:
    path, _ = model
    return LLM(path, max_model_len=MAX_LEN, max_lora_rank=12, max_loras=2, block_size=4, **kw).engine


def _prompt(rng: random.Random) -> list[int]:
    kind = rng.random()
    if kind < 0.35:
        return _SHARED + [rng.randrange(3, 1900) for _ in range(rng.randint(0, 6))]
    if kind < 0.45:
        return [rng.randrange(3, 1900) for _ in range(rng.randint(MAX_LEN - 6, MAX_LEN))]  # near the end
    return [rng.randrange(3, 1900) for _ in range(rng.randint(1, 14))]


def _params(rng: random.Random) -> dict[str, Any]:
    """Random sampling parameters (a request's dict); max_tokens 0 (refused) now and then."""
    max_tokens = rng.choice([0, 1, 2, 5, 8, 12])
    kind = rng.choice(["greedy", "greedy", "greedy", "sample", "n", "beam"])
    kw: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": rng.random() < 0.7}
    if kind == "beam":
        return dict(use_beam_search=True, n=rng.randint(1, 2), temperature=0, **kw)
    kw["temperature"] = 0.0 if kind in ("greedy", "n") else 0.9
    if kind == "n":
        kw["n"] = rng.randint(2, 3)
    if kind == "sample":
        kw["seed"] = rng.choice([None, 5])
    guided = rng.choice([{}, {}, {}, {"guided_choice": ["yes", "no way"]}, {"guided_json": _SCHEMA}])
    return dict(
        logprobs=rng.choice([None, None, 0, 2]),
        prompt_logprobs=rng.choice([None, None, None, 1]),
        stop=rng.choice([None, None, ["e"], ["the", "a"]]),
        min_tokens=rng.randint(0, max(0, max_tokens)) if max_tokens else 0,
        **guided,
        **kw,
    )


def _no_state_left(engine: LLMEngine) -> None:
    sched, bm = engine.scheduler, engine.block_manager
    assert not engine.requests and not engine.has_unfinished() and engine._inflight is None
    assert not sched.waiting and not sched.running and not sched.all_sequences()
    assert not sched._blocked_steps and not sched._prefix_waits and not sched._preempted_beams
    assert bm.num_used_blocks == 0 and all(r == 0 for r in bm.ref_counts), bm.ref_counts
    assert not bm._seq_hashes, bm._seq_hashes
    assert not engine.output_processor.requests, list(engine.output_processor.requests)
    assert engine._num_sync_requests == engine._num_host_readers == 0
    assert engine._num_prompt_logprobs == engine._num_adapter_requests == 0
    assert all(a.in_flight == 0 for a in engine.list_adapters())
    assert all(v == 0 for v in engine.registry.stats()["in_flight"].values())
    engine.check_invariants()


def _first_tie_break(got: list[int], want: list[int], want_logprobs: list[Any]) -> int | None:
    """The first position where ``got`` took another token than ``want`` whose raw logprob there
    is within 1e-4 of ``want``'s pick (a greedy near-tie, which batch shape may break either
    way), or None where the two first differ otherwise or do not differ."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            top = want_logprobs[i] if i < len(want_logprobs) else {}
            if a in top and b in top and abs(top[a].logprob - top[b].logprob) <= 1e-4:
                return i
            return None
    return None


def _drive(model: tuple[str, dict[str, str]], seed: int) -> None:
    rng = random.Random(seed)
    _, folders = model
    engine = _engine(
        model,
        num_kv_blocks=rng.choice([11, 14]),
        max_num_batched_tokens=rng.choice([6, 12]),
        max_num_seqs=rng.choice([3, 5]),
        async_scheduling=rng.random() < 0.5,
    )
    loaded: dict[str, str] = {}  # name -> folder key it serves now
    for name in ("a0", "a1", "a2"):
        engine.load_adapter(name, folders[name])
        loaded[name] = name
    issued: list[str] = []
    greedy: dict[str, tuple[list[int], SamplingParams, str | None]] = {}  # rid -> what to replay
    finals: dict[str, Any] = {}
    aborted: set[str] = set()
    for step in range(400):
        if step < 30:
            for _ in range(rng.choice([0, 0, 1, 1, 2])):
                prompt, kw = _prompt(rng), _params(rng)
                adapter = rng.choice([None, "a0", "a1", "a2"])
                try:
                    req = engine.add_request(prompt, kw, adapter=adapter)
                    sp, rid = req.params, req.request_id
                except (InvalidParamError, LimitExceededError, AdapterNotFoundError, ValueError) as exc:
                    expected = (
                        kw["max_tokens"] == 0
                        or (adapter is not None and adapter not in loaded)
                        or (kw.get("use_beam_search") and isinstance(exc, LimitExceededError))
                        or len(prompt) >= MAX_LEN
                    )
                    assert expected, f"seed {seed}: {prompt} {kw} on {adapter}: {exc!r}"
                    continue
                assert sp.max_tokens > 0 and len(prompt) < MAX_LEN
                issued.append(rid)
                if sp.temperature == 0 and not sp.use_beam_search:
                    greedy[rid] = (prompt, sp, loaded[adapter] if adapter is not None else None)
            if issued and rng.random() < 0.2:  # any request: waiting, mid-prefill, preempted, done
                rid = rng.choice(issued + ["nope"])
                was_live = rid in engine.requests
                out = engine.abort_request(rid)
                assert (out is not None) == was_live, f"seed {seed}: abort of {rid}"
                if out is not None:
                    assert out.finished and rid not in finals, f"seed {seed}: {rid} ended twice"
                    finals[rid] = out
                    aborted.add(rid)
            if rng.random() < 0.1:  # operator: unload, reload other weights, put back
                name = rng.choice(["a0", "a1", "a2"])
                if name in loaded and rng.random() < 0.5:
                    engine.unload_adapter(name)
                    del loaded[name]
                else:
                    key = "a0x" if name == "a0" and loaded.get("a0") == "a0" else name
                    engine.load_adapter(name, folders[key])
                    loaded[name] = key
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, f"seed {seed}: {out.request_id} ended twice"
                finals[out.request_id] = out
        engine.check_invariants()
        if step >= 30 and not engine.has_unfinished():
            break
    else:
        raise AssertionError(f"seed {seed}: did not drain: {engine.scheduler.all_sequences()}")
    assert set(finals) == set(issued), f"seed {seed}: {set(issued) - set(finals)} never ended"
    _no_state_left(engine)
    # Each greedy request that ran to its end outputs what it outputs alone on a roomy engine.
    ref = _engine(model, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=8)
    for key in ("a0", "a1", "a2", "a0x"):
        ref.load_adapter(key, folders[key])
    for rid, (prompt, sp, key) in greedy.items():
        if rid in aborted:
            continue
        # The replay also asks for the top 5 logprobs (greedy picks stay the same) to tell exact
        # logit ties apart: seed 7337 met tokens 33346 and 31079 both at -8.3061.
        replay = dataclasses.replace(sp, logprobs=max(sp.logprobs or 0, 5))
        alone = ref.add_request(prompt, replay, adapter=key).request_id
        outs = [o for _ in range(200) if ref.has_unfinished() for o in ref.step() if o.finished]
        assert len(outs) == 1 and outs[0].request_id == alone
        got, want = finals[rid], outs[0]
        assert len(got.outputs) == len(want.outputs), f"seed {seed}: {rid}"
        for g, w in zip(got.outputs, want.outputs, strict=True):
            tie = _first_tie_break(list(g.token_ids), list(w.token_ids), w.logprobs or [])
            if tie is not None:  # the same up to a greedy near-tie: exempt from there on
                assert list(g.token_ids)[:tie] == list(w.token_ids)[:tie]
                continue
            assert (g.index, list(g.token_ids), g.text, g.finish_reason) == (
                w.index,
                list(w.token_ids),
                w.text,
                w.finish_reason,
            ), f"seed {seed}: {rid} {prompt} {sp} on {key}"
    _no_state_left(ref)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_engine_workload_leaks_nothing_and_matches_solo_runs(model, seed: int) -> None:  # noqa: ANN001
    _drive(model, seed)
