"""Scheduling fairness and overload review: regressions found against vLLM v1's scheduler."""

from __future__ import annotations

from lorastar.engine.block_manager import BlockManager
from lorastar.engine.request import Request, SeqStatus, Sequence
from lorastar.engine.sampling import SamplingParams
from lorastar.engine.scheduler import Scheduler, SchedulerOutput

BS = 4


def test_preempted_beam_is_not_held_back_by_another_adapters_starvation() -> None:
    """A beam search on adapter A (the only slot) has one beam preempted while a request for
    adapter B has starved for a slot. The other beams wait for the preempted one's proposal while
    holding A's slot: holding that beam back "until A drains" never ends (A cannot drain without
    it), so neither the beam search nor B ever ran again."""
    bm = BlockManager(32, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_loras=1, starvation_steps=2)
    params = SamplingParams(n=2, use_beam_search=True, max_tokens=8)
    beam = Request("beam", None, list(range(8)), params, adapter_key="A")
    beam.beam = object()  # a BeamState in the engine; the scheduler only asks whether there is one
    first = beam.sequences[0]
    sched.add(first)
    sched.update(sched.schedule())
    beams = [first, Sequence(beam, 0, list(first.token_ids), 8)]
    sched.add_forked(first, beams[1])
    beam.forked = True
    other = Request("other", None, list(range(100, 106)), SamplingParams(max_tokens=2), adapter_key="B")
    sched.add(other.sequences[0])
    for i, s in enumerate(beams):  # one lockstep beam step: each beam computes its proposal
        s.token_ids.append(100 + i)
    for _ in range(3):  # B finds A's beams in the only slot each step: it starves
        sched.update(sched.schedule())
    assert sched._is_starving(other.sequences[0])
    beams[0].token_ids.append(200)  # the next proposal of one beam; the other is preempted first
    sched.update(sched.schedule())
    sched._preempt(beams[1], SchedulerOutput())  # what running out of blocks did to it
    for _ in range(4):
        sched.update(sched.schedule())
        if beams[1].status is SeqStatus.RUNNING:
            break
    assert beams[1].status is SeqStatus.RUNNING, "the preempted beam never came back"
    assert other.sequences[0].status is SeqStatus.WAITING  # B still waits for A's slot
    for s in beams:  # the search ends: A's slot frees and B goes first
        sched.finish(s, "length")
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [other.sequences[0]]
    bm.check_invariants(sched.all_sequences())
