"""Review probes of priority scheduling (``EngineConfig.scheduling_policy="priority"``): adapters of a
request that preempts for a seat, the waiting queue's order around preempted beams, seat preemption
that cannot make room, and end-to-end runs (n > 1, beams, speculative decoding, int64 bounds)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorastar import LLM, SamplingParams
from lorastar.engine.block_manager import BlockManager
from lorastar.engine.request import Request, SeqStatus, Sequence
from lorastar.engine.scheduler import Scheduler
from tests.conftest import make_peft_adapter
from tests.engine.test_scheduler_priority import _add, _harness
from tests.models.test_llama_vs_hf import hf_greedy, mixed_prompts

NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tiny_model_dir: Any) -> tuple[str, list[list[int]], list[list[int]]]:
    path = tiny_model_dir("llama-gqa")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = mixed_prompts(21, [5, 17, 9, 30])
    return path, prompts, [hf_greedy(hf, p, NEW) for p in prompts]


def _run_engine(eng: Any, arrivals: dict[int, list[tuple[Any, ...]]]) -> dict[str, Any]:
    """Step ``eng`` to the end; ``arrivals[step]``: ``(prompt, params, request_id, priority, adapter)``."""
    done: dict[str, Any] = {}
    step = 0
    while eng.has_unfinished() or any(k >= step for k in arrivals):
        for prompt, params, rid, prio, adapter in arrivals.get(step, []):
            eng.add_request(prompt, params, request_id=rid, priority=prio, adapter=adapter)
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
        assert step < 500, "no progress"
    return done


# ---- adapters --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("max_num_seqs", "low_adapter", "async_scheduling"),
    [(2, None, False), (2, None, True), (3, None, False), (2, "b", False)],
    ids=["preempts", "preempts-async", "free-seat", "preempts-beside-another-adapter"],
)
def test_an_urgent_adapter_request_runs_with_its_adapter(
    base: Any, tmp_path: Path, max_num_seqs: int, low_adapter: str | None, async_scheduling: bool
) -> None:
    """Priority-1 requests running; a priority-0 request arrives for adapter ``a``, in no device
    slot yet. ``_make_seats`` (which runs whenever a waiting request outranks a running one, a free
    seat or not) adds ``a`` to ``pinned``, so the admission takes it as resident and never reserves a
    slot: its prefill runs on the base model (or, beside another adapter's rows, the step fails on
    the missing slot). Its output must be the one it gets alone."""
    path, prompts, refs = base
    folders = {k: make_peft_adapter(path, tmp_path / k, seed, r=8) for k, seed in (("a", 3), ("b", 4))}

    def make() -> LLM:
        llm = LLM(
            path, scheduling_policy="priority", max_num_seqs=max_num_seqs, num_kv_blocks=64,
            max_model_len=128, max_loras=2, max_lora_rank=8, async_scheduling=async_scheduling,
        )  # fmt: skip
        for name, folder in folders.items():
            llm.load_adapter(name, folder)
        return llm

    ref = make().generate(
        [prompts[0], prompts[3], prompts[1]], GREEDY, adapter=["a", low_adapter, low_adapter]
    )
    alone = [o.outputs[0].token_ids for o in ref]
    assert alone[0] != refs[0]  # the adapter changes the output
    eng = make().engine
    done = _run_engine(
        eng,
        {
            0: [(prompts[3], GREEDY, "low-a", 1, low_adapter), (prompts[1], GREEDY, "low-b", 1, low_adapter)],
            3: [(prompts[0], GREEDY, "urgent", 0, "a")],
        },
    )
    assert eng.scheduler.stats.num_preemptions == (1 if max_num_seqs == 2 else 0)
    assert [done[r].outputs[0].token_ids for r in ("urgent", "low-a", "low-b")] == alone
    eng.check_invariants()
    assert not eng.requests and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_no_base_model_kv_is_cached_under_an_adapter(base: Any, tmp_path: Path) -> None:
    """The same path (a free seat: no preemption at all): the urgent request's first prompt block,
    computed without its adapter, is registered in the prefix cache under the adapter's hash, so a
    later request of that adapter and prompt, alone in the engine, reads it and answers wrongly
    long after the first one ended."""
    path, prompts, refs = base
    folder = make_peft_adapter(path, tmp_path / "a", 3, r=8)

    def make() -> LLM:
        llm = LLM(
            path, scheduling_policy="priority", max_num_seqs=3, num_kv_blocks=64, max_model_len=128,
            max_loras=2, max_lora_rank=8,
        )  # fmt: skip
        llm.load_adapter("a", folder)
        return llm

    alone = make().generate([prompts[3]], GREEDY, adapter="a")[0].outputs[0].token_ids
    llm = make()
    _run_engine(
        llm.engine,
        {
            0: [(prompts[0], GREEDY, "low-a", 1, None), (prompts[1], GREEDY, "low-b", 1, None)],
            3: [(prompts[3], GREEDY, "urgent", 0, "a")],
        },
    )
    later = llm.generate([prompts[3]], GREEDY, adapter="a")[0]
    assert later.num_cached_tokens == 16  # its first block came from the prefix cache
    assert later.outputs[0].token_ids == alone


def test_make_seats_reserves_the_adapter_it_pins() -> None:
    """Scheduler level: a waiting sequence that preempts for a seat is admitted only with its
    adapter reserved (``ensure_adapter`` called for it), as any other admission is."""
    asked: list[str] = []

    def ensure(seq: Any, pinned: set[str]) -> bool:
        asked.append(seq.request.request_id)
        return True

    h = _harness("priority", max_num_seqs=2, ensure_adapter=ensure)
    _add(h, 5, 1, max_tokens=10)
    _add(h, 5, 1, max_tokens=10)
    h.step()
    req = Request("urgent", None, list(range(6)), SamplingParams(max_tokens=3), priority=0, adapter_key="A")
    h.requests.append(req)
    h.sched.add(req.sequences[0])
    out = h.step()
    assert len(out.preempted) == 1
    assert req.sequences[0].status is SeqStatus.RUNNING
    assert "urgent" in asked  # admitted without its adapter made resident otherwise
    h.run()
    h.assert_all_done()


# ---- the waiting queue's order ------------------------------------------------------------------
def test_queue_stays_in_priority_order_after_preempted_beams_go_first() -> None:
    """``_beams_first`` moves preempted beams (of a low priority here) to the queue's front, and
    ``add`` then bisects a queue that is no longer sorted: a priority-3 arrival lands at the very
    front, ahead of a waiting priority-0 request, and is admitted before it."""
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64, max_loras=1, policy="priority")
    holders = [Request(f"h{i}", None, [i + 1] * 5, SamplingParams(max_tokens=50)) for i in range(2)]
    for r in holders:  # two running priority-0 requests hold both seats
        sched.add(r.sequences[0])
    sched.update(sched.schedule())
    beam = Request(
        "beam", None, list(range(8)), SamplingParams(n=2, use_beam_search=True, max_tokens=8), priority=5
    )
    beam.beam = object()  # a BeamState in the engine; the scheduler only asks whether there is one
    beam.sequences.append(Sequence(beam, 1, list(range(8)), 8))
    beam.forked = True
    for s in beam.sequences:  # two beams preempted earlier (block pressure takes the lowest priority)
        sched.add(s)
        sched._preempted_beams.add(s.seq_id)
    x = Request("x", None, [9] * 5, SamplingParams(max_tokens=4), priority=0)
    sched.add(x.sequences[0])
    sched.update(sched.schedule())  # no free seat: _beams_first only reorders the queue
    z = Request("z", None, [30] * 5, SamplingParams(max_tokens=4), priority=3)
    sched.add(z.sequences[0])
    order = [s.request.request_id for s in sched.waiting if s.request.beam is None]
    assert order == ["x", "z"], [s.request.request_id for s in sched.waiting]


# ---- seat preemption ------------------------------------------------------------------------------
def test_no_seat_preemption_that_cannot_seat_the_request() -> None:
    """Four seats: r0 (priority 1) and three priority-0 requests. A priority-0 request of n=2 needs
    two seats, and only r0 is of a lower priority: preempting it frees one, not enough. It must not
    be preempted for nothing (it would lose its KV and sit in the queue while its seat stays empty,
    the n=2 request at the head waiting for a second one)."""
    h = _harness("priority", max_num_seqs=4, prefix=False)
    _add(h, 5, 1, max_tokens=12)
    for _ in range(3):
        _add(h, 5, 0, max_tokens=12)
    h.step()
    assert len(h.sched.running) == 4
    _add(h, 5, 0, max_tokens=4, n=2)
    out = h.step()
    assert out.preempted == []
    assert "r0" in {s.request.request_id for s in h.sched.running}
    h.run()
    h.assert_all_done()


def test_seat_preemption_frees_enough_seats_for_an_n_request() -> None:
    """(passes) Two priority-1 requests and two priority-0 ones: an n=2 priority-0 request preempts
    both priority-1 ones (the latest first) and starts in the same step."""
    h = _harness("priority", max_num_seqs=4, prefix=False)
    _add(h, 5, 1, max_tokens=12)
    _add(h, 5, 1, max_tokens=12)
    _add(h, 5, 0, max_tokens=12)
    _add(h, 5, 0, max_tokens=12)
    h.step()
    urgent = _add(h, 5, 0, max_tokens=4, n=2)
    out = h.step()
    assert sorted(s.request.request_id for s in out.preempted) == ["r0", "r1"]
    assert urgent.sequences[0].status is SeqStatus.RUNNING
    assert [s.request.request_id for s in h.sched.waiting] == ["r0", "r1"]
    h.run()
    h.assert_all_done()


# ---- end to end (these pass) ----------------------------------------------------------------------
def test_n_and_beams_under_seat_and_block_pressure_match_a_roomy_run(base: Any) -> None:
    """Greedy n=2, a beam search and plain requests of mixed priorities on 3 seats and 5 blocks of 16
    (seat and block preemptions): every output is the one a roomy FCFS engine gives, nothing leaks."""
    path, prompts, refs = base
    n2 = SamplingParams(n=2, temperature=0, max_tokens=NEW, ignore_eos=True)
    beam = SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=NEW, ignore_eos=True)
    params = [GREEDY, n2, beam, GREEDY]
    roomy = LLM(path, num_kv_blocks=64, max_model_len=128).generate(prompts, params)
    want = [[c.token_ids for c in o.outputs] for o in roomy]
    llm = LLM(path, scheduling_policy="priority", max_num_seqs=3, num_kv_blocks=5, max_model_len=128)
    eng = llm.engine
    done = _run_engine(
        eng,
        {
            0: [(prompts[3], GREEDY, "r3", 2, None), (prompts[2], beam, "r2", 1, None)],
            2: [(prompts[1], n2, "r1", 0, None)],
            4: [(prompts[0], GREEDY, "r0", -1, None)],
        },
    )
    got = [[c.token_ids for c in done[f"r{i}"].outputs] for i in range(4)]
    assert got == want
    assert want[0] == [refs[0]] and want[1] == [refs[1], refs[1]]
    assert eng.scheduler.stats.num_preemptions >= 1
    eng.check_invariants()
    assert not eng.requests and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_speculative_decoding_with_seat_preemption_stays_hf(base: Any) -> None:
    path, prompts, refs = base
    llm = LLM(
        path, scheduling_policy="priority", max_num_seqs=2, num_kv_blocks=10, max_model_len=128,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    )  # fmt: skip
    eng = llm.engine
    done = _run_engine(
        eng,
        {
            0: [(prompts[3], GREEDY, "r3", 1, None), (prompts[1], GREEDY, "r1", 1, None)],
            2: [(prompts[0], GREEDY, "r0", 0, None), (prompts[2], GREEDY, "r2", 0, None)],
        },
    )
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(4)] == refs
    assert eng.scheduler.stats.num_preemptions >= 1
    eng.check_invariants()
    assert not eng.requests and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_aborting_a_preempted_request_frees_everything(base: Any) -> None:
    path, prompts, refs = base
    llm = LLM(path, scheduling_policy="priority", max_num_seqs=1, num_kv_blocks=32, max_model_len=128)
    eng = llm.engine
    eng.add_request(prompts[3], GREEDY, request_id="low", priority=5)
    eng.step()
    eng.step()
    eng.add_request(prompts[0], GREEDY, request_id="hi", priority=0)
    eng.step()
    low = [s for s in eng.scheduler.waiting if s.request.request_id == "low"]
    assert low and low[0].num_preemptions == 1  # preempted for the seat
    eng.abort_request("low")
    done = _run_engine(eng, {})
    assert done["hi"].outputs[0].token_ids == refs[0]
    eng.check_invariants()
    assert not eng.requests and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_int64_bound_priorities_order_and_finish(base: Any) -> None:
    path, prompts, refs = base
    llm = LLM(path, scheduling_policy="priority", max_num_seqs=1, num_kv_blocks=32, max_model_len=128)
    prio = [2**63 - 1, -(2**63), 0]
    outs = llm.generate(prompts[:3], GREEDY, priority=prio)
    assert [o.outputs[0].token_ids for o in outs] == refs[:3]
    started = sorted(range(3), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert started == [1, 2, 0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_seat_victim_is_not_readmitted_in_the_step_it_was_preempted(
    tiny_model_dir: Any, async_scheduling: bool
) -> None:
    """b (priority 2) decodes, c (priority 1) prefills in chunks, a (priority 0) shares c's first two
    blocks and arrives while c computes the second: ``_make_seats`` preempts b for a, a then waits
    for c's in-flight block (prefix sharing), and the admission hands the freed seat straight back
    to b, which recomputes, only to be preempted again the next step. One preemption is all a needs
    (outputs stay HF's either way, with async scheduling too: b is re-admitted with a token in flight)."""
    from lorastar.config import EngineConfig
    from lorastar.engine.engine import LLMEngine

    path = tiny_model_dir("llama-gqa")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    c, b, tail = mixed_prompts(21, [40, 5, 5])
    a = c[:32] + tail
    eng = LLMEngine(
        EngineConfig(
            model=path, device="cpu", num_kv_blocks=64, max_model_len=128, max_num_seqs=2,
            max_num_batched_tokens=24, scheduling_policy="priority", async_scheduling=async_scheduling,
        )
    )  # fmt: skip
    done = _run_engine(
        eng,
        {0: [(b, GREEDY, "b", 2, None)], 2: [(c, GREEDY, "c", 1, None)], 3: [(a, GREEDY, "a", 0, None)]},
    )
    assert {k: done[k].outputs[0].token_ids for k in "abc"} == {
        k: hf_greedy(hf, p, NEW) for k, p in (("a", a), ("b", b), ("c", c))
    }
    eng.check_invariants()
    assert eng.scheduler.stats.num_preemptions == 1


# ---- run-batch and --config (these pass) ----------------------------------------------------------
@pytest.fixture
def restore_lorastar_logger() -> Iterator[None]:
    """As tests/plugin/conftest.py's: an in-process CLI run's handler and level on the ``lorastar``
    logger are put back."""
    import logging

    log = logging.getLogger("lorastar")
    handlers, propagate, level = list(log.handlers), log.propagate, log.level
    yield
    log.handlers[:] = handlers
    log.propagate, log.level = propagate, level


@pytest.mark.usefixtures("restore_lorastar_logger")
@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_run_batch_lines_carry_priority_with_the_policy_from_a_config_file(
    tiny_model_dir: Any, tmp_path: Path, policy: str
) -> None:
    import json

    from click.testing import CliRunner

    from lorastar.plugin.cli import main

    def line(cid: str, **body: Any) -> str:
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body})

    inp, out, cfg = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "c.yaml"
    cfg.write_text(f"scheduling-policy: {policy}\nmax-num-seqs: 1\n", encoding="utf-8")
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    inp.write_text(
        "\n".join(line(c, **body, priority=p) for c, p in (("a", 3), ("b", -(2**63)), ("c", 0))) + "\n",
        encoding="utf-8",
    )
    args = [
        "run-batch",
        "-i",
        str(inp),
        "-o",
        str(out),
        str(tiny_model_dir("llama-gqa")),
        "--config",
        str(cfg),
    ]
    args += ["--served-model-name", "tiny", "--device", "cpu", "--no-engine-process", "--disable-log-stats"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output[-2000:]
    records = {x["custom_id"]: x for x in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    status = {k: v["response"]["status_code"] for k, v in records.items()}
    if policy == "priority":
        assert status == {"a": 200, "b": 200, "c": 200}
    else:
        assert status == {"a": 400, "b": 400, "c": 200}
        assert records["a"]["error"]["error"]["param"] == "priority", records["a"]
