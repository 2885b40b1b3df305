"""CUDA graphs for decode steps: one captured forward (up to the final norm) per padded batch size.

A decode step launches ~20 kernels per layer from Python; at small batches that launch overhead,
not the GPU, sets the step time. A pure-decode step (every sequence one new token) of ``b``
sequences instead replays the graph captured for the next size up (1, 2, 4, 8, 16, 24, ...) on
static input buffers. Padding rows write their K/V into a scratch block no sequence owns, read
only that block, carry no adapter, and their outputs are dropped.

Graphs are captured lazily, the first time a size is needed, after an eager warm-up run on the
same buffers (Triton compiles outside the capture). Attention is captured for ``max_model_len``
contexts (the kernels stop at each row's ``seq_lens`` on the device); LoRA graphs run the same
sorted shrink/expand as eager steps (rows ordered by adapter slot, each slot's run read from the
static ``[2, max_loras]`` buffer at replay, so one graph serves any mix of adapters). Adapter
weights and ranks are read from the slot buffers at replay, so hot-loading an adapter needs no
recapture unless it allocates a new linear's buffers (``LoRADeviceState.layout_version``), which
drops the LoRA graphs. If a capture fails (an op that
cannot be captured), decode falls back to eager for good, with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from lorastar.forward_context import AttentionMetadata, ForwardContext, LoRAMetadata, slot_runs, to_device

if TYPE_CHECKING:
    from lorastar.engine.input_batch import StepInputs
    from lorastar.layers.lora import LoRADeviceState
    from lorastar.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes with a graph: 1, 2, 4, then multiples of 8 up to the first size that
    holds ``max_batch`` (padding wastes at most 7 rows)."""
    sizes = [1, 2, 4, *range(8, max_batch + 8, 8)]
    top = next(s for s in sizes if s >= max_batch)
    return [s for s in sizes if s <= top]


class DecodeGraphs:
    """The captured decode graphs of one runner, keyed by (padded batch size, with LoRA), and the
    static input buffers they read."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        k_scales: list[float],
        v_scales: list[float],
        *,
        block_size: int,
        max_model_len: int,
        scratch_block: int,
        max_batch: int,
        lora_state: LoRADeviceState | None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.k_scales = k_scales
        self.v_scales = v_scales
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.lora_state = lora_state
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        dev = kv_caches[0][0].device
        n = self.max_batch
        max_blocks = -(-max_model_len // block_size)
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        # Static inputs; rows past the live batch always hold the padding values.
        self.i64 = torch.zeros(3, n, dtype=torch.int64, device=dev)  # input_ids, positions, slot_mapping
        self.i64[2] = self.scratch_slot
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        # (start, count) of each adapter slot's rows; rows are sorted by slot, padding has none.
        self.lora_runs = torch.zeros(
            2, lora_state.max_loras if lora_state else 1, dtype=torch.int32, device=dev
        )
        self.block_tables = torch.full((n, max_blocks), scratch_block, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: tuple[int, int] | None = None
        self.lora_version = lora_state.layout_version if lora_state is not None else 0
        self.prev_batch = n  # rows [0, prev_batch) may hold a previous step's values
        self.disabled = False

    def padded_size(self, batch: int) -> int | None:
        for s in self.sizes:
            if s >= batch:
                return s
        return None

    # ---- one forward on the static buffers -------------------------------------------------------
    def _context(self, n: int, with_lora: bool) -> ForwardContext:
        md = AttentionMetadata(
            slot_mapping=self.i64[2, :n],
            query_start_loc=self.query_start_loc[: n + 1],
            seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
        )
        lora = None
        if with_lora and self.lora_state is not None:
            lora = LoRAMetadata(
                ranges=[], max_rank=self.lora_state.max_rank, max_rows=n, slot_runs=self.lora_runs
            )
        return ForwardContext(
            attn=md, lora=lora, kv_caches=self.kv_caches, k_scales=self.k_scales, v_scales=self.v_scales,
        )  # fmt: skip

    def _forward(self, n: int, with_lora: bool) -> torch.Tensor:
        ctx = self._context(n, with_lora)
        return self.model(self.i64[0, :n], self.i64[1, :n], ctx)  # [n, hidden]

    def _capture(self, n: int, with_lora: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self._forward(n, with_lora)  # warm-up (compiles kernels); the replay rewrites the same K/V
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(n, with_lora)
        if self.pool is None:
            self.pool = graph.pool()
        torch.cuda.synchronize()
        return graph, out

    # ---- a step -------------------------------------------------------------------------------
    def run(
        self,
        inputs: StepInputs,
        lora_ranges: list[tuple[int, int, int]] | None,
        patch_ids: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor | None:
        """Logits ``[b, vocab]`` (row order) of one decode step of ``b`` sequences prepared by
        ``InputBatch.prepare``, or ``None`` when graphs cannot serve it (too many sequences, or
        disabled after a failed capture). ``lora_ranges``: each adapter's rows ``(slot, start,
        end)`` (rows sorted by slot), or ``None`` for a step without adapters. ``patch_ids``:
        writes the input ids that are still on the device (async scheduling) into the static
        ``[b]`` ids after the host's are copied."""
        b = inputs.num_seqs
        n = self.padded_size(b)
        if self.disabled or n is None or not inputs.is_decode:
            return None
        with_lora = lora_ranges is not None and self.lora_state is not None
        if with_lora and self.lora_state.layout_version != self.lora_version:  # type: ignore[union-attr]
            self.graphs = {k: v for k, v in self.graphs.items() if not k[1]}
            self.lora_version = self.lora_state.layout_version  # type: ignore[union-attr]
        # Rows [b, prev_batch) held live values last time: back to padding before the copy.
        if self.prev_batch > b:
            self.i64[:2, b : self.prev_batch] = 0
            self.i64[2, b : self.prev_batch] = self.scratch_slot
            self.seq_lens[b : self.prev_batch] = 1
            self.block_tables[b : self.prev_batch, 0] = self.scratch_block
        self.prev_batch = b
        width = inputs.block_tables.shape[1]  # padded with the scratch block (the runner's fill)
        step = np.stack([inputs.input_ids, inputs.positions, inputs.slot_mapping])  # [3, b]
        self.i64[:, :b].copy_(to_device(step, self.i64.device))
        if patch_ids is not None:
            patch_ids(self.i64[0, :b])
        self.seq_lens[:b].copy_(to_device(inputs.seq_lens, self.seq_lens.device))
        if with_lora:
            self.lora_runs.copy_(slot_runs(lora_ranges or [], self.lora_runs.shape[1], self.lora_runs.device))
        self.block_tables[:b, :width].copy_(to_device(inputs.block_tables, self.block_tables.device))
        key = (n, with_lora)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(n, with_lora)
            except RuntimeError as e:  # an op in the forward cannot be captured: stay eager
                logger.warning("CUDA graph capture failed (%s); decode steps run eagerly from now on", e)
                self.disabled = True
                self.graphs.clear()
                return None
            self.graphs[key] = entry
        graph, hidden = entry
        graph.replay()
        # The lm_head runs outside the graph, on the live rows only: each graph keeps just its
        # [n, hidden] output alive, not [n, vocab] logits.
        return self.model.compute_logits(hidden[:b]).float()
