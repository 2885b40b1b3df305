"""The scheduler's ``policy="priority"`` (vLLM's ``--scheduling-policy priority``), torch-free: the
waiting queue, each step's token budget and the preemption victim go by ``(priority, arrival)``,
lower first; FCFS keeps its order. Runs on test_scheduler's harness (a fake step, no model)."""

from __future__ import annotations

import random

import pytest

from lorastar.engine.block_manager import BlockManager
from lorastar.engine.request import Request, SeqStatus
from lorastar.engine.sampling import SamplingParams
from lorastar.engine.scheduler import Scheduler, SchedulerOutput, priority_key
from tests.engine.test_scheduler import BS, Harness, beam_search_seqs, tokens_of


def _harness(policy: str, **kw: object) -> Harness:
    h = Harness(**kw)  # type: ignore[arg-type]
    old = h.sched
    h.sched = Scheduler(
        h.bm,
        max_num_seqs=old.max_num_seqs,
        max_num_batched_tokens=old.max_num_batched_tokens,
        max_loras=old.max_loras,
        ensure_adapter=old.ensure_adapter,
        starvation_steps=old.starvation_steps,
        policy=policy,
    )
    return h


def _add(
    h: Harness, prompt: list[int] | int, priority: int, max_tokens: int = 4, **params: object
) -> Request:
    ids = list(range(prompt)) if isinstance(prompt, int) else list(prompt)
    sp = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    req = Request(f"r{len(h.requests)}", None, ids, sp, priority=priority)
    h.requests.append(req)
    h.sched.add(req.sequences[0])
    return req


def _admission_order(h: Harness) -> list[str]:
    order: list[str] = []
    while h.sched.has_work():
        out = h.step()
        for s in out.scheduled:
            rid = s.seq.request.request_id
            if rid not in order:
                order.append(rid)
    return order


@pytest.mark.parametrize(
    ("policy", "expected"), [("fcfs", ["r0", "r1", "r2", "r3"]), ("priority", ["r1", "r3", "r2", "r0"])]
)
def test_waiting_requests_are_admitted_by_priority_then_arrival(policy: str, expected: list[str]) -> None:
    h = _harness(policy, max_num_seqs=1)
    for p in (3, 0, 1, 0):  # r1 and r3 tie on priority: r1 arrived first
        _add(h, 5, 0 if policy == "fcfs" else p)
    assert _admission_order(h) == expected
    h.assert_all_done()


def test_preemption_takes_the_lowest_priority_not_the_newest() -> None:
    """The oldest request is the least important (r0, priority 5, admitted a step before r1 and
    r2) and no block is free when r1 grows: FCFS preempts the newest (r2), priority r0, over r2's
    priority 3. r0 then waits behind a later arrival of higher priority but ahead of a later one
    of its own."""
    victims: dict[str, str] = {}
    for policy in ("fcfs", "priority"):
        prio = policy == "priority"
        h = _harness(policy, num_blocks=6, budget=64, prefix=False)
        _add(h, [0] * 6, 5 if prio else 0, max_tokens=12)
        assert len(h.step().scheduled) == 1
        _add(h, [1] * 8, 0, max_tokens=12)
        _add(h, [2] * 8, 3 if prio else 0, max_tokens=12)
        assert len(h.step().scheduled) == 3  # all 6 blocks held
        out = h.step()
        assert len(out.preempted) == 1
        victims[policy] = out.preempted[0].request.request_id
        if prio:
            assert [s.request.request_id for s in h.sched.running] == ["r1", "r2"]
            _add(h, 3, 5)  # r3: r0's priority, later
            _add(h, 3, 1)  # r4: more important than r0
            assert [s.request.request_id for s in h.sched.waiting] == ["r4", "r0", "r3"]
        h.run()
        h.assert_all_done()
    assert victims == {"fcfs": "r2", "priority": "r0"}


def test_a_high_priority_prompt_takes_the_budget_before_lower_decodes() -> None:
    """FCFS runs every decode before any prefill chunk; priority orders them by priority first
    (a priority's decodes still before its own prefill chunks)."""
    for policy, expected in (("fcfs", {"r0": 1, "r1": 3}), ("priority", {"r1": 4})):
        h = _harness(policy, budget=4, prefix=False)
        prio = policy == "priority"
        _add(h, 2, 1 if prio else 0, max_tokens=10)
        h.step()  # r0's prompt
        _add(h, 12, 0)  # r1: a long prompt, more important
        assert tokens_of(h.step()) == {"r0/0": 1, "r1/0": 3}  # r0 was running first: its decode
        assert {k.split("/")[0]: v for k, v in tokens_of(h.step()).items()} == expected
        h.run()
        h.assert_all_done()


def test_decodes_come_before_prefill_chunks_within_a_priority() -> None:
    h = _harness("priority", budget=5, prefix=False)
    _add(h, 2, 0, max_tokens=10)  # r0: decoding, priority 0
    _add(h, 2, 2, max_tokens=10)  # r1: decoding, priority 2
    h.step()
    _add(h, 9, 0)  # r2: a prompt of priority 0
    _add(h, 9, 2)  # r3: a prompt of priority 2
    h.step()  # r0, r1 decode; r2 takes the rest (3)
    out = h.step()
    assert [s.seq.request.request_id for s in out.scheduled] == ["r0", "r2", "r1", "r3"][: len(out.scheduled)]
    assert tokens_of(out) == {"r0/0": 1, "r2/0": 4}
    h.run()
    h.assert_all_done()


def test_unknown_policy_is_refused() -> None:
    h = Harness()
    with pytest.raises(ValueError, match="policy must be 'fcfs' or 'priority'"):
        Scheduler(h.bm, max_num_seqs=1, max_num_batched_tokens=8, max_loras=1, policy="lifo")


@pytest.mark.parametrize("prefix", [True, False])
def test_random_priority_workload_keeps_invariants_and_order(prefix: bool) -> None:
    """Random arrivals, priorities, n > 1, adapters, aborts and block pressure: nothing is lost
    (every request ends with its full output, every block comes back), the waiting queue stays
    sorted by (priority, arrival), and every preemption takes a sequence no more important than
    any sequence the step runs."""
    rng = random.Random(99)
    h = _harness("priority", num_blocks=14, budget=12, max_num_seqs=6, max_loras=2, prefix=prefix)
    preempted = 0

    def add() -> None:
        ids = [7] * rng.choice([0, 4, 8]) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        sp = SamplingParams(n=rng.choice([1, 1, 2]), max_tokens=rng.randrange(1, 16))
        req = Request(
            f"r{len(h.requests)}", None, ids, sp, priority=rng.randrange(-2, 3),
            adapter_key=rng.choice([None, None, "A", "B", "C"]),
        )  # fmt: skip
        h.requests.append(req)
        h.sched.add(req.sequences[0])

    def check(out: object) -> None:
        nonlocal preempted
        preempted += len(out.preempted)  # type: ignore[attr-defined]
        keys = [priority_key(s) for s in h.sched.waiting]
        assert keys == sorted(keys)
        for victim in out.preempted:  # type: ignore[attr-defined]
            for x in out.scheduled:  # type: ignore[attr-defined]
                assert x.seq.request.priority <= victim.request.priority

    h.on_schedule = check
    for _ in range(200):
        if rng.random() < 0.45:
            add()
        if rng.random() < 0.04:
            live = [r for r in h.requests if not r.is_finished]
            if live:
                victim = rng.choice(live)
                h.sched.abort(victim)
                h.requests.remove(victim)
        if h.sched.has_work():
            h.step()
    h.run(max_steps=3000)
    h.assert_all_done()
    assert preempted > 0  # the pool is small enough for the workload to preempt


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_more_important_request_takes_a_seat_from_a_less_important_one(policy: str) -> None:
    """Every seat taken by priority-1 requests: a priority-0 arrival preempts the latest of them and
    runs in the same step (vLLM v1 would wait for one to finish); FCFS waits."""
    prio = policy == "priority"
    h = _harness(policy, max_num_seqs=2, prefix=False)
    _add(h, 6, 1 if prio else 0, max_tokens=20)
    _add(h, 6, 1 if prio else 0, max_tokens=20)
    h.step()
    h.step()
    _add(h, 5, 0, max_tokens=3)  # r2
    out = h.step()
    if prio:
        assert [s.request.request_id for s in out.preempted] == ["r1"]
        assert tokens_of(out) == {"r0/0": 1, "r2/0": 5}
        assert [s.request.request_id for s in h.sched.waiting] == ["r1"]
    else:
        assert not out.preempted and tokens_of(out) == {"r0/0": 1, "r1/0": 1}
    h.run()
    h.assert_all_done()


def test_equal_priorities_and_ending_sequences_are_not_preempted_for_a_seat() -> None:
    h = _harness("priority", max_num_seqs=2, prefix=False)
    _add(h, 6, 1, max_tokens=20)
    _add(h, 6, 0, max_tokens=20)
    h.step()
    _add(h, 5, 0, max_tokens=3)  # r2: outranks only r0, whose last token is in flight
    h.requests[0].sequences[0].ends_pending = True
    out = h.step()
    assert not out.preempted and "r2/0" not in tokens_of(out)
    h.requests[0].sequences[0].ends_pending = False
    out = h.step()
    assert [s.request.request_id for s in out.preempted] == ["r0"] and "r2/0" in tokens_of(out)
    _add(h, 5, 0, max_tokens=3)  # r3: as important as everyone running: waits for a free seat
    out = h.step()
    assert not out.preempted and "r3/0" not in tokens_of(out)
    h.run()
    h.assert_all_done()


def test_no_seat_is_taken_for_a_request_whose_adapter_cannot_get_a_slot() -> None:
    h = _harness("priority", max_num_seqs=1, max_loras=1, prefix=False)
    low = Request("low", None, list(range(6)), SamplingParams(max_tokens=8), adapter_key="A", priority=1)
    h.requests.append(low)
    h.sched.add(low.sequences[0])
    h.step()
    high = Request("high", None, list(range(5)), SamplingParams(max_tokens=2), adapter_key="B", priority=0)
    h.requests.append(high)
    h.sched.add(high.sequences[0])
    out = h.step()  # B cannot get the only slot while A is held: preempting would buy nothing
    assert not out.preempted
    h.run()
    h.assert_all_done()


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "c"), ("priority", "b")])
def test_a_stalled_beam_search_takes_the_cache_from_the_lowest_priority_search(
    policy: str, victim: str
) -> None:
    """Every running sequence is a beam waiting for a preempted sibling that does not fit (see
    test_scheduler's two-search stall): one other search gives up its beams. FCFS takes the newest
    search's; the priority policy takes the lowest priority's, though it arrived first."""
    bm = BlockManager(12, BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_loras=1, policy=policy)

    a = beam_search_seqs(sched, "a", 8, 5, 0)  # 13 tokens a beam: 2 shared prompt blocks + 2 own each
    b = beam_search_seqs(sched, "b", 4, 1, 1)  # 5 tokens a beam: 1 shared prompt block + 1 own each
    c = beam_search_seqs(sched, "c", 4, 1, 0)  # as b, later, at a higher priority (a lower value)
    assert bm.num_used_blocks == 12
    out = SchedulerOutput()
    sched._preempt(a[1], out)  # what running out of blocks did to it: it needs 4, 2 are free
    step = sched.schedule()  # every running beam waits for a proposal; the queue head does not fit
    assert not step.scheduled
    assert {s.request.request_id for s in step.preempted} == {victim}
    step = sched.schedule()
    assert [s.seq for s in step.scheduled] == [a[1]]
    others = {"b": b, "c": c}
    assert all(s.status is SeqStatus.RUNNING for s in others["c" if victim == "b" else "b"])
    assert all(s.status is SeqStatus.WAITING for s in others[victim])
    bm.check_invariants(sched.all_sequences())
