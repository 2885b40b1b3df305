"""The persistent input batch and the one input-preparation path (vLLM v1's ``InputBatch``).

Each live sequence owns a row of preallocated arrays that outlive the step: its block table and its
sampling parameters (``SamplingTable``, written once: a step's ``SamplingMetadata`` is a gather of
rows). A block-table row is written when its sequence is first scheduled and then only where its
block table changed (a block appended, a copy-on-write replacement, entries released by the sliding
window, the table emptied by a preemption), so a step's tables are one gather of rows instead of a
table rebuilt from lists for every sequence. Rows go back when the scheduler reports their sequence
finished.

How the batch learns what changed: ``Sequence.block_table_synced`` is a watermark, the number of
leading ``block_table`` entries the row holds as they are. The block manager lowers it whenever it
rewrites an entry in place; appends need nothing (the table outgrows the watermark). The
invariant ``rows[row, :synced] == block_table[:synced]`` is checked by ``check``.

``prepare`` is the one path from a schedule to model inputs: eager steps (``device_inputs``),
CUDA-graph replay (``DecodeGraphs.run`` copies the same arrays into its static buffers) and
KV-scale calibration all take a ``StepInputs`` from it.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from lorastar.engine.request import Sequence
from lorastar.engine.sampler import SamplingMetadata, SamplingTable
from lorastar.engine.scheduler import ScheduledSeq
from lorastar.forward_context import AttentionMetadata, to_device
from lorastar.layers.attention import build_attention_metadata


@dataclass
class StepInputs:
    """One step's model inputs on the host. Rows are ordered by adapter slot (each adapter's
    tokens one contiguous run, ``LoRAMetadata``'s encoding); ``order[j]`` is the schedule index of
    the ``j``-th sequence in row order."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64: block * block_size + offset of each new token
    query_lens: np.ndarray  # [B] int64, row order
    seq_lens: np.ndarray  # [B] int64, row order: context after this step
    block_tables: np.ndarray  # [B, W] int32, row order; entries past a table's end hold the fill
    order: list[int]  # [B] schedule index per row-order sequence
    last_row: list[int]  # [B] flat row of each scheduled sequence's last token, schedule order
    lora_runs: list[tuple[int, int]] | None  # (slot or -1, rows) per sequence in row order

    @property
    def num_seqs(self) -> int:
        return len(self.order)

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one new token."""
        return len(self.input_ids) == len(self.order)


def adapter_order(
    scheduled: Seq[ScheduledSeq], adapter_slot: dict[str, int] | None
) -> tuple[list[int], list[int]]:
    """Each scheduled sequence's adapter slot (-1: none) and the row order that sorts them by slot
    (schedule order when the step has no adapters; the sort is stable)."""
    order = list(range(len(scheduled)))
    if adapter_slot is None:
        return [], order
    seq_slots = [-1 if s.seq.adapter_key is None else adapter_slot[s.seq.adapter_key] for s in scheduled]
    order.sort(key=seq_slots.__getitem__)
    return seq_slots, order


class InputBatch:
    """Block-table rows that persist across steps, one per live sequence, and ``prepare``."""

    def __init__(self, block_size: int, max_model_len: int, *, fill: int = 0, rows: int = 8) -> None:
        self.block_size = block_size
        self.fill = fill  # the entry past a table's end (a CUDA graph's scratch block, or 0)
        cols = -(-max_model_len // block_size) + 1
        self.tables = np.full((rows, cols), fill, dtype=np.int32)  # [rows, max_blocks]
        self.lengths = np.zeros(rows, dtype=np.int64)  # entries of each row's table
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self.sampling = SamplingTable(rows)  # each row's sampling parameters
        self._free = list(range(rows - 1, -1, -1))

    # ---- rows -------------------------------------------------------------------------------------
    def _grow(self, rows: int, cols: int) -> None:
        old_rows, old_cols = self.tables.shape
        tables = np.full((max(rows, old_rows), max(cols, old_cols)), self.fill, dtype=np.int32)
        tables[:old_rows, :old_cols] = self.tables
        self.tables = tables
        if rows > old_rows:
            self.lengths = np.concatenate([self.lengths, np.zeros(rows - old_rows, dtype=np.int64)])
            self.sampling.grow(rows)
            self._free.extend(range(rows - 1, old_rows - 1, -1))

    def _row(self, seq: Sequence) -> int:
        """``seq``'s row, written up to date."""
        row = self.row_of.get(seq.seq_id)
        if row is not None and seq.block_table_synced == len(seq.block_table) != 0:
            return row  # most decode steps: unchanged since written (an emptied table must clear its row)
        if row is None:
            if not self._free:
                self._grow(2 * self.tables.shape[0], 0)
            row = self.row_of[seq.seq_id] = self._free.pop()
            seq.block_table_synced = 0
            self.sampling.set(row, seq.request.params)
        table = seq.block_table
        n, synced = len(table), seq.block_table_synced
        if synced < n:
            if n > self.tables.shape[1]:
                self._grow(0, n)
            self.tables[row, synced:n] = table[synced:]
        old = int(self.lengths[row])
        if old > n:  # the table shrank (a preemption emptied it): back to the fill
            self.tables[row, n:old] = self.fill
        self.lengths[row] = n
        seq.block_table_synced = n
        return row

    def sampling_metadata(self, seqs: Iterable[Sequence]) -> SamplingMetadata:
        """The sampling parameters of ``seqs`` (each holding a row), in that order."""
        row_of = self.row_of
        return self.sampling.take([row_of[s.seq_id] for s in seqs])

    def remove(self, seq_ids: Iterable[int]) -> None:
        """Give back the rows of finished sequences (ids without a row are ignored)."""
        for sid in seq_ids:
            row = self.row_of.pop(sid, None)
            if row is not None:
                self.tables[row, : self.lengths[row]] = self.fill
                self.lengths[row] = 0
                self._free.append(row)

    def check(self, live: Iterable[Sequence]) -> None:
        """Every live sequence's row holds its table up to the watermark; rows of no live
        sequence are the finished ones not yet reported."""
        for seq in live:
            row = self.row_of.get(seq.seq_id)
            if row is None:
                continue
            k = seq.block_table_synced
            if k > len(seq.block_table) or self.tables[row, :k].tolist() != seq.block_table[:k]:
                raise AssertionError(f"input batch row {row} disagrees with seq {seq.seq_id}'s block table")
            if (self.tables[row, self.lengths[row] :] != self.fill).any():
                raise AssertionError(f"input batch row {row} holds entries past its table")
            if self.sampling.take([row]) != SamplingMetadata.from_params([seq.request.params]):
                raise AssertionError(
                    f"input batch row {row} holds other sampling parameters than seq {seq.seq_id}"
                )

    # ---- a step -----------------------------------------------------------------------------------
    def prepare(self, scheduled: Seq[ScheduledSeq], adapter_slot: dict[str, int] | None = None) -> StepInputs:
        """The inputs of one forward over ``scheduled`` (rows sorted by adapter slot)."""
        seq_slots, order = adapter_order(scheduled, adapter_slot)
        ids: list[int] = []
        rows: list[int] = []
        starts: list[int] = []
        qlens: list[int] = []
        last_row = [0] * len(scheduled)
        for i in order:
            s = scheduled[i]
            seq, start, n = s.seq, s.start, s.num_new_tokens
            rows.append(self._row(seq))
            starts.append(start)
            qlens.append(n)
            ids += seq.token_ids[start : start + n]
            last_row[i] = len(ids) - 1
        row_a = np.array(rows, dtype=np.int64)  # [B]
        start_a = np.array(starts, dtype=np.int64)
        q = np.array(qlens, dtype=np.int64)
        if len(ids) == len(rows):  # decode: one token a sequence
            positions, token_rows = start_a, row_a
        else:
            ends = np.cumsum(q)
            positions = np.arange(ends[-1], dtype=np.int64) + np.repeat(start_a - (ends - q), q)  # [T]
            token_rows = np.repeat(row_a, q)
        bs = self.block_size
        blocks = self.tables[token_rows, positions // bs].astype(np.int64)  # [T]
        width = int(self.lengths[row_a].max())
        lora_runs = (
            [(seq_slots[i], qlens[j]) for j, i in enumerate(order)] if adapter_slot is not None else None
        )
        return StepInputs(
            input_ids=np.array(ids, dtype=np.int64),
            positions=positions,
            slot_mapping=blocks * bs + positions % bs,
            query_lens=q,
            seq_lens=start_a + q,
            block_tables=self.tables[row_a, :width],  # a copy: later row writes do not reach it
            order=order,
            last_row=last_row,
            lora_runs=lora_runs,
        )


def device_inputs(
    inputs: StepInputs, *, block_size: int, device: torch.device, native_cpu_decode: bool = False
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """``input_ids [T]``, ``positions [T]`` and the attention metadata of ``inputs`` on ``device``."""
    md = build_attention_metadata(
        torch.from_numpy(inputs.slot_mapping), inputs.query_lens, inputs.seq_lens,
        torch.from_numpy(inputs.block_tables), block_size=block_size, device=device,
        native_cpu_decode=native_cpu_decode,
    )  # fmt: skip
    ids = to_device(inputs.input_ids, device)
    positions = to_device(inputs.positions, device)
    return ids, positions, md
