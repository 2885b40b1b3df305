"""The persistent input batch (engine/input_batch.py) against inputs rebuilt from the sequences'
own lists every step, through the scheduler's real block manager: prefix hits, n > 1 forks
(copy-on-write), sliding-window releases, preemptions, aborts and adapters; and its sampling
parameters against each sequence's own ``SamplingParams``."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from lorastar.engine.input_batch import InputBatch
from lorastar.engine.request import Request
from lorastar.engine.sampler import SamplingMetadata
from lorastar.engine.sampling import SamplingParams
from lorastar.engine.scheduler import ScheduledSeq, SchedulerOutput
from tests.engine.test_scheduler import BS, Harness
from tests.fuzzing import budget
from tests.layers.test_attention_backends import padded_block_tables

SLOTS = {"a": 2, "b": 0, "c": 1}
FILL = 99


def rebuilt(scheduled: list[ScheduledSeq], adapter_slot: dict[str, int] | None) -> dict[str, object]:
    """The step's inputs from the sequences' lists (the runner's former per-step builder)."""
    slots = (
        [-1 if s.seq.adapter_key is None else adapter_slot[s.seq.adapter_key] for s in scheduled]
        if adapter_slot
        else []
    )
    order = (
        sorted(range(len(scheduled)), key=lambda i: slots[i]) if adapter_slot else list(range(len(scheduled)))
    )
    ids: list[int] = []
    pos: list[int] = []
    slot_mapping: list[int] = []
    tables: list[list[int]] = []
    last_row = [0] * len(scheduled)
    for i in order:
        seq, start, n = scheduled[i].seq, scheduled[i].start, scheduled[i].num_new_tokens
        ids += seq.token_ids[start : start + n]
        pos += range(start, start + n)
        slot_mapping += [seq.block_table[p // BS] * BS + p % BS for p in range(start, start + n)]
        tables.append(seq.block_table)
        last_row[i] = len(ids) - 1
    return {
        "input_ids": ids,
        "positions": pos,
        "slot_mapping": slot_mapping,
        "query_lens": [scheduled[i].num_new_tokens for i in order],
        "seq_lens": [scheduled[i].start + scheduled[i].num_new_tokens for i in order],
        "block_tables": padded_block_tables(tables, FILL).tolist(),
        "order": order,
        "last_row": last_row,
        "lora_runs": [(slots[i], scheduled[i].num_new_tokens) for i in order] if adapter_slot else None,
    }


def random_params(rng: random.Random) -> dict[str, object]:
    """Sampling parameters that differ between requests in every field the sampler reads."""
    return {
        "temperature": rng.choice([0.0, 0.7, 1.3]),
        "top_k": rng.choice([0, 5, 40]),
        "top_p": rng.choice([1.0, 0.9]),
        "min_p": rng.choice([0.0, 0.05]),
        "repetition_penalty": rng.choice([1.0, 1.2]),
        "frequency_penalty": rng.choice([0.0, 0.5]),
        "presence_penalty": rng.choice([0.0, -0.3]),
        "min_tokens": rng.choice([0, 1]),
        "logprobs": rng.choice([None, 0, 3]),
        "logit_bias": rng.choice([None, {3: 1.5}]),
    }


@budget(40, derandomize=False, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1), window=st.sampled_from([0, 6, 9]), blocks=st.sampled_from([12, 24, 64])
)
def test_batch_equals_inputs_rebuilt_every_step(seed: int, window: int, blocks: int) -> None:
    rng = random.Random(seed)
    h = Harness(num_blocks=blocks, budget=rng.choice([8, 16, 64]), max_num_seqs=6, max_loras=3)
    h.bm.sliding_window = window
    batch = InputBatch(BS, 64, fill=FILL, rows=2)  # two rows: growth is exercised too
    with_adapters = rng.random() < 0.5
    shared = [rng.randrange(50) for _ in range(12)]
    checked = 0

    def on_schedule(out: SchedulerOutput) -> None:
        nonlocal checked
        batch.remove(out.finished_seq_ids)
        if not out.scheduled:  # the engine runs no forward then
            return
        adapter_slot = SLOTS if with_adapters else None
        got = batch.prepare(out.scheduled, adapter_slot)
        want = rebuilt(out.scheduled, adapter_slot)
        for name, value in want.items():
            have = getattr(got, name)
            have = have.tolist() if isinstance(have, np.ndarray) else have
            assert have == value, name
        batch.check(h.sched.all_sequences())
        seqs = [s.seq for s in out.scheduled]
        meta = batch.sampling_metadata(seqs)
        want_meta = SamplingMetadata.from_params([seq.request.params for seq in seqs])
        assert meta == want_meta
        checked += 1

    h.on_schedule = on_schedule
    for _ in range(rng.randint(3, 10)):
        prompt = shared[: rng.randint(0, 12)] + [rng.randrange(50) for _ in range(rng.randint(1, 14))]
        adapter = rng.choice([None, "a", "b", "c"]) if with_adapters else None
        h.add(prompt, rng.randint(1, 9), adapter=adapter, n=rng.choice([1, 1, 2, 3]), **random_params(rng))
    while h.sched.has_work():
        if rng.random() < 0.08:
            live = [r for r in h.requests if not r.is_finished]
            if live:
                h.sched.abort(rng.choice(live))
        h.step()
        assert h.steps < 500
    assert checked > 0
    batch.remove(h.sched.schedule().finished_seq_ids)
    assert batch.row_of == {}, "every finished sequence gave its row back"
    assert (batch.tables == FILL).all() and (batch.lengths == 0).all()


def test_rewritten_entries_are_recopied() -> None:
    """A copy-on-write replacement and a sliding-window release rewrite entries below the end of
    the table: the watermark makes the row copy them again."""
    seq = Request("r", None, list(range(10)), SamplingParams(max_tokens=1)).sequences[0]
    seq.block_table = [5, 6, 7]
    batch = InputBatch(BS, 64)
    step = [ScheduledSeq(seq, 8, 2)]
    assert batch.prepare(step).block_tables.tolist() == [[5, 6, 7]]
    seq.block_table[2] = 9  # without lowering the watermark the row keeps 7
    assert batch.prepare(step).block_tables.tolist() == [[5, 6, 7]]
    seq.block_table_synced = 2
    assert batch.prepare(step).slot_mapping.tolist() == [9 * BS, 9 * BS + 1]
    seq.block_table = []  # a preemption empties the table; recompute refills it
    seq.block_table_synced = 0
    seq.block_table = [3]
    got = batch.prepare([ScheduledSeq(seq, 0, 4)])
    assert got.block_tables.tolist() == [[3]] and got.slot_mapping.tolist() == [12, 13, 14, 15]
    batch.check([seq])
