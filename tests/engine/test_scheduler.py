"""Scheduler unit tests (torch-free): a fake step stands in for the runner and the sampler."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from lorastar.engine.block_manager import BlockManager
from lorastar.engine.request import Request, SeqStatus, Sequence
from lorastar.engine.sampling import SamplingParams
from lorastar.engine.scheduler import Scheduler, SchedulerOutput

BS = 4


class Harness:
    """The engine's step loop without a model: schedule, update, append a token per sampling
    sequence (forking n > 1 first, like the engine), finish at ``max_tokens``."""

    def __init__(
        self,
        num_blocks: int = 64,
        *,
        budget: int = 64,
        max_num_seqs: int = 16,
        max_loras: int = 4,
        prefix: bool = True,
        ensure_adapter: Callable[[Sequence, set[str]], bool] | None = None,
        starvation_steps: int = 8,
    ) -> None:
        self.bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix)
        self.sched = Scheduler(
            self.bm,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_loras=max_loras,
            ensure_adapter=ensure_adapter,
            starvation_steps=starvation_steps,
        )
        self.requests: list[Request] = []
        self.on_schedule: Callable[[SchedulerOutput], None] | None = None  # sees each step's schedule
        self.steps = 0
        self._ids = itertools.count()

    def add(
        self,
        prompt: list[int] | int,
        max_tokens: int = 4,
        *,
        adapter: str | None = None,
        n: int = 1,
        **params: object,
    ) -> Request:
        """A request of ``prompt`` (``params``: further SamplingParams fields)."""
        ids = list(range(prompt)) if isinstance(prompt, int) else list(prompt)
        sp = SamplingParams(n=n, max_tokens=max_tokens, **params)  # type: ignore[arg-type]
        req = Request(f"r{next(self._ids)}", None, ids, sp, adapter_key=adapter)
        self.requests.append(req)
        self.sched.add(req.sequences[0])
        return req

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        assert out.num_batched_tokens <= self.sched.max_num_batched_tokens
        seats = sum(s.request.params.n if not s.request.forked else 1 for s in self.sched.running)
        # Over max_num_seqs only for a lone n > max_num_seqs request (admitted into an empty batch).
        assert (
            seats <= self.sched.max_num_seqs or len({s.request.request_id for s in self.sched.running}) == 1
        )
        for s in out.scheduled:
            assert s.num_new_tokens > 0 and s.start == s.seq.num_computed_tokens
        assert len({s.seq.seq_id for s in out.scheduled}) == len(out.scheduled)
        if self.on_schedule is not None:
            self.on_schedule(out)
        self.sched.update(out)
        for s in out.scheduled:
            seq = s.seq
            if not s.samples or seq.status is not SeqStatus.RUNNING:
                continue
            req = seq.request
            targets = [seq]
            if req.params.n > 1 and not req.forked:
                for k in range(1, req.params.n):
                    child = Sequence(req, k, seq.token_ids[: seq.num_prompt_tokens], seq.num_prompt_tokens)
                    self.sched.add_forked(seq, child)
                    req.sequences.append(child)
                    targets.append(child)
                req.forked = True
            for t in targets:
                t.token_ids.append(1000 + 100 * t.index + t.num_output_tokens)
                if t.num_output_tokens >= req.params.max_tokens:
                    self.sched.finish(t, "length")
        self.bm.check_invariants(self.sched.all_sequences())
        self.steps += 1
        return out

    def run(self, max_steps: int = 1000) -> None:
        while self.sched.has_work():
            self.step()
            assert self.steps < max_steps, "no progress"

    def assert_all_done(self) -> None:
        for req in self.requests:
            assert req.is_finished
            assert len(req.sequences) == req.params.n
            for seq in req.sequences:
                assert seq.finish_reason == "length"
                assert seq.output_token_ids == [
                    1000 + 100 * seq.index + i for i in range(req.params.max_tokens)
                ]
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert sum(self.bm.ref_counts) == 0
        assert self.bm._seq_hashes == {}
        self.bm.check_invariants([])


def ids_of(out: SchedulerOutput) -> list[str]:
    return [f"{s.seq.request.request_id}/{s.seq.index}" for s in out.scheduled]


def tokens_of(out: SchedulerOutput) -> dict[str, int]:
    return {f"{s.seq.request.request_id}/{s.seq.index}": s.num_new_tokens for s in out.scheduled}


# ---- basics -----------------------------------------------------------------------------------
def test_single_request_prefill_then_decodes() -> None:
    h = Harness()
    req = h.add(6, max_tokens=3)
    out = h.step()
    assert tokens_of(out) == {"r0/0": 6} and out.scheduled[0].samples
    assert h.step().num_batched_tokens == 1
    h.run()
    assert h.steps == 3
    h.assert_all_done()
    assert req.sequences[0].status is SeqStatus.FINISHED
    assert not h.sched.has_work()


def test_empty_schedule() -> None:
    h = Harness()
    out = h.sched.schedule()
    assert out.is_empty and out.num_batched_tokens == 0


def test_token_budget_respected_many_requests() -> None:
    h = Harness(num_blocks=256, budget=10)
    for i in range(12):
        h.add(3 + i % 7, max_tokens=5)
    batched = []
    while h.sched.has_work():
        batched.append(h.step().num_batched_tokens)
    assert max(batched) <= 10 and batched.count(10) >= 3
    h.assert_all_done()


def test_decodes_before_new_prefills() -> None:
    h = Harness(budget=8)
    for _ in range(3):
        h.add(2, max_tokens=10)
    h.step()  # all three prefilled together (6 tokens)
    h.add(20, max_tokens=2)
    out = h.step()
    assert ids_of(out)[:3] == ["r0/0", "r1/0", "r2/0"]
    assert tokens_of(out) == {"r0/0": 1, "r1/0": 1, "r2/0": 1, "r3/0": 5}
    assert not out.scheduled[3].samples


def test_chunked_prefill_with_decodes_mixed_in() -> None:
    h = Harness(budget=8)
    h.add(3, max_tokens=30)
    h.add(3, max_tokens=30)
    h.step()
    long = h.add(40, max_tokens=2)
    seq = long.sequences[0]
    chunks = []
    while seq.num_output_tokens == 0:
        out = h.step()
        assert tokens_of(out)["r0/0"] == 1 and tokens_of(out)["r1/0"] == 1  # decodes never starve
        chunk = next(s for s in out.scheduled if s.seq is seq)
        assert chunk.samples == (chunk.start + chunk.num_new_tokens == 40)
        chunks.append(chunk.num_new_tokens)
    assert chunks == [6] * 6 + [4]
    assert len(seq.block_table) == 10  # 40 computed tokens; the sampled 41st gets its block next step
    h.run()
    h.assert_all_done()


def test_prefill_chunks_never_starve_decodes_behind_them() -> None:
    """Bug: running sequences were served strictly oldest first, so a prefill chunk older than a
    decoding sequence took the whole budget. A forked n > 1 sample (appended to ``running``
    after a long prompt still in prefill) made no progress until that prompt was done."""
    h = Harness(budget=8)
    fork = h.add(4, max_tokens=3, n=2)
    h.add(40, max_tokens=1)  # admitted in the same step with the 4 tokens left: a chunk
    h.step()
    kid = fork.sequences[1]
    assert kid.num_output_tokens == 1
    out = h.step()
    t = tokens_of(out)
    assert t["r0/0"] == 1 and t["r0/1"] == 1 and t["r1/0"] == 6
    h.run()
    h.assert_all_done()


def test_max_num_seqs() -> None:
    h = Harness(max_num_seqs=2)
    for _ in range(5):
        h.add(3, max_tokens=3)
    out = h.step()
    assert ids_of(out) == ["r0/0", "r1/0"]
    peak = 0
    while h.sched.has_work():
        h.step()
        peak = max(peak, len(h.sched.running))
    assert peak == 2
    h.assert_all_done()


def test_n_gt_max_num_seqs_runs_alone() -> None:
    h = Harness(max_num_seqs=2)
    h.add(3, max_tokens=2, n=3)  # needs 3 seats: admitted only into an empty batch
    h.add(3, max_tokens=2)
    h.run()
    h.assert_all_done()


def test_n_seats_reserved_for_fork() -> None:
    h = Harness(max_num_seqs=3)
    h.add(3, max_tokens=3, n=2)
    h.add(3, max_tokens=3, n=2)  # 2 + 2 > 3: waits
    out = h.step()
    assert ids_of(out) == ["r0/0"]
    assert len(h.sched.running) == 2  # parent + forked child
    h.run()
    h.assert_all_done()


# ---- preemption -------------------------------------------------------------------------------
def test_preemption_newest_first_recompute_and_no_loss() -> None:
    h = Harness(num_blocks=8, budget=64, prefix=False)
    reqs = [h.add([i] * 7, max_tokens=12) for i in range(3)]  # 3 x 2 blocks, growing to 5 each
    first = h.step()
    assert len(first.scheduled) == 3
    preempted: list[Sequence] = []
    while not preempted:
        out = h.step()
        preempted = out.preempted
    victim = preempted[0]
    assert victim.request is reqs[-1]  # the newest
    assert h.sched.waiting[0] is victim and victim.block_table == [] and victim.num_computed_tokens == 0
    assert victim.num_preemptions == 1 and h.sched.stats.num_preemptions >= 1
    n_before = victim.num_tokens
    # When it comes back it recomputes prompt + generated tokens in one go and then samples.
    while True:
        out = h.step()
        mine = [s for s in out.scheduled if s.seq is victim]
        if mine:
            assert mine[0].start == 0 and mine[0].num_new_tokens == n_before and mine[0].samples
            break
    assert victim.num_tokens == n_before + 1
    h.run()
    h.assert_all_done()


def test_preemption_restores_prefix_from_cache() -> None:
    h = Harness(num_blocks=5, budget=64, prefix=True)
    a = h.add([1] * 8, max_tokens=2)
    b = h.add([2] * 8, max_tokens=4)
    h.step()  # 2 full blocks each (committed to the prefix cache), 1 block free
    out = h.step()  # a takes the last block for its decode; b must preempt itself
    victim = b.sequences[0]
    assert out.preempted == [victim] and ids_of(out) == ["r0/0"]
    assert a.is_finished  # a's 2 tokens are done: its blocks are free again
    out = h.step()
    # b's full blocks were still cached: the recompute starts after them and samples at once.
    assert len(out.scheduled) == 1
    s = out.scheduled[0]
    assert (s.seq, s.start, s.num_new_tokens, s.samples) == (victim, 8, 1, True)
    h.run()
    h.assert_all_done()
    assert h.sched.stats.prefix_queries == 16 and h.sched.stats.prefix_hits == 0  # first admissions only


def test_preemption_under_heavy_pressure_loses_nothing() -> None:
    h = Harness(num_blocks=10, budget=16, max_num_seqs=8)
    for i in range(10):
        h.add([i % 3] * (5 + i), max_tokens=6 + i % 4, n=1 + i % 2)
    h.run()
    assert h.sched.stats.num_preemptions > 0
    h.assert_all_done()


def test_no_admission_in_a_step_that_preempted() -> None:
    h = Harness(num_blocks=4, budget=64, prefix=False)
    a = h.add([1] * 8, max_tokens=8)
    b = h.add([2] * 8, max_tokens=8)
    h.step()  # a, b: 2 blocks each, all used
    h.add([3], max_tokens=1)
    out = h.step()  # a needs a third block: b is preempted
    assert out.preempted == [b.sequences[0]]
    assert ids_of(out) == ["r0/0"]
    assert a.sequences[0].status is SeqStatus.RUNNING
    assert [s.request.request_id for s in h.sched.waiting] == ["r1", "r2"]
    h.run()
    h.assert_all_done()


def test_self_preemption_when_alone_with_scheduled_peers() -> None:
    h = Harness(num_blocks=3, budget=64, prefix=False)
    h.add([1] * 4, max_tokens=5)
    h.add([2] * 4, max_tokens=1)
    h.run()
    h.assert_all_done()


# ---- abort / finish ---------------------------------------------------------------------------
def test_abort_frees_blocks_at_once() -> None:
    h = Harness(budget=8)
    running = h.add(6, max_tokens=10)
    chunked = h.add(20, max_tokens=10)
    waiting = h.add(6, max_tokens=10)
    h.step()
    assert chunked.sequences[0].status is SeqStatus.RUNNING and chunked.sequences[0].block_table
    assert waiting.sequences[0].status is SeqStatus.WAITING
    free = h.bm.num_free_blocks
    h.sched.abort(running)
    assert running.is_finished and running.sequences[0].finish_reason == "abort"
    assert h.bm.num_free_blocks == free + 2
    h.sched.abort(chunked)
    h.sched.abort(waiting)
    assert h.bm.num_free_blocks == h.bm.num_blocks
    assert not h.sched.has_work()
    h.bm.check_invariants([])
    h.sched.abort(waiting)  # twice: harmless


def test_abort_between_schedule_and_update() -> None:
    h = Harness()
    req = h.add(6, max_tokens=4)
    out = h.sched.schedule()
    h.sched.abort(req)
    h.sched.update(out)  # the aborted sequence is skipped
    assert h.bm.num_free_blocks == h.bm.num_blocks and req.sequences[0].num_computed_tokens == 0


def test_abort_forked_request() -> None:
    h = Harness()
    req = h.add(6, max_tokens=10, n=3)
    h.step()
    h.step()
    assert len(req.sequences) == 3
    h.sched.abort(req)
    assert req.is_finished and h.bm.num_free_blocks == h.bm.num_blocks


def test_abort_n_gt_1_before_fork_finishes_request() -> None:
    h = Harness()
    req = h.add(6, max_tokens=10, n=3)
    h.sched.abort(req)
    assert req.is_finished and not h.sched.has_work()


# ---- adapters ---------------------------------------------------------------------------------
def test_max_loras_distinct_adapters_per_step() -> None:
    h = Harness(max_loras=2)
    for i in range(12):
        h.add(3, max_tokens=3, adapter=[None, "A", "B", "C"][i % 4])
    while h.sched.has_work():
        out = h.step()
        keys = {s.seq.adapter_key for s in out.scheduled} - {None}
        assert len(keys) <= 2
    h.assert_all_done()


def test_blocked_adapter_does_not_block_requests_behind_it() -> None:
    h = Harness(max_loras=1)
    h.add(3, max_tokens=5, adapter="A")
    h.add(3, max_tokens=5, adapter="B")  # no slot this step
    h.add(3, max_tokens=5)  # base
    h.add(3, max_tokens=5, adapter="A")  # same adapter as a running one
    out = h.step()
    assert ids_of(out) == ["r0/0", "r2/0", "r3/0"]
    assert [s.request.request_id for s in h.sched.waiting] == ["r1"]
    h.run()
    h.assert_all_done()


def test_ensure_adapter_failure_skips_only_that_adapter() -> None:
    broken = {"X"}
    h = Harness(ensure_adapter=lambda seq, pinned: seq.adapter_key not in broken)
    h.add(3, max_tokens=2, adapter="X")
    h.add(3, max_tokens=2, adapter="Y")
    out = h.step()
    assert ids_of(out) == ["r1/0"]
    broken.clear()
    h.run()
    h.assert_all_done()


def test_ensure_adapter_gets_pinned_keys() -> None:
    calls: list[tuple[str | None, set[str]]] = []

    def ensure(seq: Sequence, pinned: set[str]) -> bool:
        calls.append((seq.adapter_key, set(pinned)))
        return True

    h = Harness(ensure_adapter=ensure)
    h.add(3, max_tokens=3, adapter="A")
    h.step()
    h.add(3, max_tokens=3, adapter="B")
    calls.clear()
    h.step()
    # The running A may not be evicted to make room for B; A itself is not pinned against itself.
    assert ("A", set()) in calls and ("B", {"A"}) in calls


def test_rare_adapter_is_not_starved() -> None:
    steps_limit = 40
    h = Harness(num_blocks=256, max_loras=1, starvation_steps=4)
    for _ in range(4):
        h.add(3, max_tokens=3, adapter="A")
    rare = h.add(3, max_tokens=2, adapter="B")
    base_progress = []
    for _ in range(steps_limit):
        out = h.step()
        base_progress.append(any(s.seq.adapter_key is None for s in out.scheduled))
        if rare.is_finished:
            break
        # Keep the popular adapter busy: a new A request every step, plus base traffic.
        h.add(3, max_tokens=3, adapter="A")
        h.add(3, max_tokens=2)
    assert rare.is_finished, "the rare adapter starved"
    assert h.steps <= 4 + 3 + 4  # starvation threshold + A's drain + B's own run
    assert all(base_progress[1:]), "base requests are never held back by adapter starvation"
    h.run()
    h.assert_all_done()


# ---- prefix cache stats / fork ----------------------------------------------------------------
def test_prefix_stats_counted_once_per_request() -> None:
    h = Harness()
    prompt = list(range(13))
    a = h.add(prompt, max_tokens=2)
    h.run()
    b = h.add(prompt, max_tokens=2)
    h.run()
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 12
    assert h.sched.stats.prefix_queries == 26 and h.sched.stats.prefix_hits == 12
    h.assert_all_done()


def test_prefix_hit_shares_blocks_with_running_request() -> None:
    h = Harness()
    prompt = list(range(10))
    a = h.add(prompt, max_tokens=5)
    h.step()
    b = h.add(prompt, max_tokens=5)
    out = h.step()
    sb = next(s for s in out.scheduled if s.seq is b.sequences[0])
    assert sb.start == 8 and sb.num_new_tokens == 2
    shared = a.sequences[0].block_table[:2]
    assert b.sequences[0].block_table[:2] == shared
    assert all(h.bm.ref_counts[x] == 2 for x in shared)
    h.run()
    h.assert_all_done()


def test_fork_shares_prompt_blocks_copy_on_write() -> None:
    h = Harness()
    req = h.add(6, max_tokens=4, n=3)
    h.step()
    parent, *kids = req.sequences
    assert len(kids) == 2
    full, partial = parent.block_table
    assert all(k.block_table == [full, partial] for k in kids)
    assert h.bm.ref_counts[full] == 3 and h.bm.ref_counts[partial] == 3
    out = h.step()
    # Two of the three writers copy the shared partial block; the last keeps the original.
    assert len(out.copies) == 2 and all(src == partial for src, _ in out.copies)
    assert len({s.block_table[1] for s in req.sequences}) == 3
    assert h.bm.ref_counts[full] == 3
    h.run()
    h.assert_all_done()
    outs = {tuple(s.output_token_ids) for s in req.sequences}
    assert len(outs) == 3


def test_forked_child_finishing_first_keeps_parent_blocks() -> None:
    h = Harness()
    req = h.add(5, max_tokens=1, n=2)
    h.step()  # prefill + sample: both samples reach max_tokens at once
    assert req.is_finished
    h.assert_all_done()


@pytest.mark.parametrize("prefix", [True, False])
def test_random_workload_invariants(prefix: bool) -> None:
    import random

    rng = random.Random(1234)
    h = Harness(num_blocks=24, budget=12, max_num_seqs=6, max_loras=2, prefix=prefix)
    for _ in range(150):
        if rng.random() < 0.4:
            shared = [7] * rng.choice([0, 4, 8])
            h.add(
                shared + [rng.randrange(50) for _ in range(rng.randrange(1, 12))],
                max_tokens=rng.randrange(1, 8),
                adapter=rng.choice([None, None, "A", "B", "C"]),
                n=rng.choice([1, 1, 2]),
            )
        if rng.random() < 0.05:
            live = [r for r in h.requests if not r.is_finished]
            if live:
                victim = rng.choice(live)
                h.sched.abort(victim)
                h.requests.remove(victim)
        if h.sched.has_work():
            h.step()
    h.run(max_steps=2000)
    h.assert_all_done()


def test_running_sequence_whose_adapter_is_unavailable_is_skipped() -> None:
    down: set[str] = set()
    h = Harness(ensure_adapter=lambda seq, pinned: seq.adapter_key not in down)
    a = h.add(3, max_tokens=4, adapter="A")
    h.add(3, max_tokens=4)
    h.step()
    down.add("A")
    out = h.step()
    assert ids_of(out) == ["r1/0"] and a.sequences[0].status is SeqStatus.RUNNING
    down.clear()
    h.run()
    h.assert_all_done()


def test_abort_clears_adapter_wait_bookkeeping() -> None:
    h = Harness(max_loras=1, starvation_steps=2)
    h.add(3, max_tokens=20, adapter="A")
    b = h.add(3, max_tokens=2, adapter="B")
    for _ in range(3):
        h.step()
    assert h.sched._blocked_steps == {b.sequences[0].seq_id: 3}
    h.sched.abort(b)
    h.requests.remove(b)
    assert h.sched._blocked_steps == {}
    h.add(3, max_tokens=2, adapter="A")  # not held back by a starvation that no longer exists
    out = h.step()
    assert ids_of(out) == ["r0/0", "r2/0"]
    h.run()
    h.assert_all_done()


# ---- in-batch prefix sharing -----------------------------------------------------------------


def test_waiting_sequence_takes_a_prefix_computed_in_flight() -> None:
    """Two requests with the same 12-token prefix arrive together: the second waits while the first
    computes the shared blocks, then takes them from the prefix cache instead of computing them too."""
    h = Harness(budget=64)
    h.sched.max_prefix_waits = 32
    first = h.add(list(range(12)) + [50, 51, 52], max_tokens=2)
    second = h.add(list(range(12)) + [60, 61], max_tokens=2)
    h.step()
    assert first.sequences[0].status is SeqStatus.RUNNING
    assert second.sequences[0].status is SeqStatus.WAITING  # held back one step
    assert h.sched.stats.prefix_waits == 1
    h.step()
    seq = second.sequences[0]
    assert seq.status is SeqStatus.RUNNING and seq.num_cached_blocks == 3  # 12 tokens = 3 blocks of 4
    assert h.sched.stats.prefix_hits == 12
    h.run()
    h.assert_all_done()


def test_prefix_waits_are_bounded_and_off_by_default() -> None:
    h = Harness(budget=64)
    a = h.add(list(range(12)) + [1], max_tokens=2)
    b = h.add(list(range(12)) + [2], max_tokens=2)
    h.step()
    assert a.sequences[0].status is b.sequences[0].status is SeqStatus.RUNNING  # default: no waiting
    h.run()
    h.assert_all_done()

    h = Harness(budget=64)
    h.sched.max_prefix_waits = 2
    seq = h.add(list(range(12)) + [7]).sequences[0]
    inflight = {h.bm.hashes(seq, 1)[0]: False}
    assert h.sched._waits_for_sibling(seq, 0, inflight)
    assert h.sched._waits_for_sibling(seq, 0, inflight)
    assert not h.sched._waits_for_sibling(seq, 0, inflight)  # waited max_prefix_waits steps already
    assert not h.sched._waits_for_sibling(seq, 1, inflight)  # its next block is not the one in flight
    pl = Request("pl", None, list(range(12)) + [7], SamplingParams(prompt_logprobs=1)).sequences[0]
    assert not h.sched._waits_for_sibling(pl, 0, {h.bm.hashes(pl, 1)[0]: False})  # no kept logprobs
    assert h.sched._waits_for_sibling(pl, 0, {h.bm.hashes(pl, 1)[0]: True})


def test_output_ids_view_reads_in_place() -> None:
    """A sampling row's output ids: the list slice's behaviour, and later appends show through."""
    from lorastar.engine.request import OutputIds

    ids = [9, 8, 7, 1, 2, 3]
    view = OutputIds(ids, 3)
    assert len(view) == 3 and list(view) == [1, 2, 3] and view[0] == 1 and view[-1] == 3
    assert view[1:] == [2, 3] and view[::-1] == [3, 2, 1]
    with pytest.raises(IndexError):
        view[3]
    with pytest.raises(IndexError):
        view[-4]
    ids.append(4)
    assert len(view) == 4 and view[-1] == 4 and list(view) == ids[3:]
    assert len(OutputIds(ids, len(ids))) == 0 and list(OutputIds(ids, len(ids))) == []


def test_a_preempted_beam_is_readmitted_before_a_queue_head_that_does_not_fit() -> None:
    """Beam search advances in lockstep: beams whose proposals are in wait for a preempted sibling
    while holding their blocks. With a bigger request at the head of the queue that does not fit,
    FIFO admission stalled the sibling (and so the beams, and the engine) for good; the sibling
    goes first, and fits because its prompt blocks are cached."""
    bm = BlockManager(12, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_loras=1)
    beam = Request("beam", None, list(range(16)), SamplingParams(n=3, use_beam_search=True, max_tokens=8))
    beam.beam = object()  # a BeamState in the engine; the scheduler only asks whether there is one
    first = beam.sequences[0]
    sched.add(first)
    sched.update(sched.schedule())  # the prompt: 4 full blocks, committed to the prefix cache
    beams = [first] + [Sequence(beam, 0, list(first.token_ids), 16) for _ in range(2)]
    for child in beams[1:]:
        sched.add_forked(first, child)
    beam.forked = True
    for i, s in enumerate(beams):  # each beam's token from the last proposal
        s.token_ids.append(100 + i)
    sched.update(sched.schedule())  # 3 beams x 1 block of their own: 7 blocks used
    assert bm.num_used_blocks == 7
    for i, s in enumerate(beams[:2]):  # two beams proposed again; the third has not
        s.token_ids.append(200 + i)
    big = Request("big", None, list(range(1000, 1028)), SamplingParams(max_tokens=4))
    sched.add(big.sequences[0])  # 7 blocks: more than the 6 free once the third beam is out
    out = SchedulerOutput()
    sched._preempt(beams[2], out)  # what running out of blocks did to it
    sched.waiting.rotate(-1)  # the big request ahead of it (it arrived first)
    assert sched.waiting[0] is big.sequences[0]
    step = sched.schedule()
    (mine,) = [s for s in step.scheduled if s.seq is beams[2]]
    assert beams[2].status is SeqStatus.RUNNING and big.sequences[0].status is SeqStatus.WAITING
    assert mine.start == 16  # its prompt blocks came from the prefix cache
    bm.check_invariants(sched.all_sequences())


def beam_search_seqs(
    sched: Scheduler, rid: str, prompt_len: int, outputs: int, priority: int = 0
) -> list[Sequence]:
    """A two-beam search ``rid`` run ``outputs`` lockstep steps on ``sched``: its two beams, running."""
    sp = SamplingParams(n=2, use_beam_search=True, max_tokens=8)
    req = Request(rid, None, list(range(prompt_len)), sp, priority=priority)
    req.beam = object()  # a BeamState in the engine; the scheduler only asks whether there is one
    first = req.sequences[0]
    sched.add(first)
    sched.update(sched.schedule())
    beams = [first, Sequence(req, 0, list(first.token_ids), prompt_len)]
    sched.add_forked(first, beams[1])
    req.forked = True
    for k in range(outputs):  # lockstep beam steps: each beam gets a token, then computes it
        for i, s in enumerate(beams):
            s.token_ids.append(100 * i + k)
        sched.update(sched.schedule())
    return beams


def test_two_beam_searches_each_with_a_preempted_beam_do_not_stall() -> None:
    """Two beam searches, each with a beam preempted, can fill the cache with beams that wait for
    their preempted siblings' proposals while the first such sibling needs more blocks than are
    free: no step would ever run again (a random mixed workload found it on a 12-block cache). The
    newest other search's beams are preempted whole and queued behind the stalled search's beam,
    which runs first; the other resumes after it."""
    bm = BlockManager(9, BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_loras=1)

    a = beam_search_seqs(sched, "a", 8, 5)  # 13 tokens a beam: 2 shared prompt blocks + 2 own blocks each
    b = beam_search_seqs(sched, "b", 4, 1)  # 5 tokens a beam: 1 shared prompt block + 1 own block each
    assert bm.num_used_blocks == 9
    out = SchedulerOutput()
    sched._preempt(b[1], out)  # what running out of blocks did to them
    sched._preempt(a[1], out)
    assert list(sched.waiting) == [a[1], b[1]] and bm.num_free_blocks == 3  # a[1] needs 4
    step = sched.schedule()  # every running beam waits for a proposal; the queue head does not fit
    assert not step.scheduled and step.preempted == [b[0]]
    assert list(sched.waiting) == [a[1], b[0], b[1]]
    step = sched.schedule()
    assert [s.seq for s in step.scheduled] == [a[1]] and a[1].status is SeqStatus.RUNNING
    assert b[0].status is SeqStatus.WAITING
    bm.check_invariants(sched.all_sequences())
