"""The one object passed down the model for a forward pass (no module-level globals)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the paged KV cache. Built once per step by the runner
    (through ``layers/attention.py``, whose CPU backend extends it with its own fields).

    The flat batch holds ``B`` sequences; sequence ``b`` owns query rows
    ``query_start_loc[b]:query_start_loc[b+1]`` and, after this step, ``seq_lens[b]`` tokens of
    context (its new tokens included). Row ``i`` of a sequence with ``q`` new tokens sits at
    position ``seq_lens[b] - q + i`` and attends to positions ``<=`` that (causal).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset for each new token
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32 (padding entries are 0 and never read)
    max_query_len: int
    max_seq_len: int
    block_size: int
    # RoPE cos/sin for this step's positions, computed once and shared by all layers.
    rope_cos: torch.Tensor | None = None  # [num_tokens, 1, head_dim]
    rope_sin: torch.Tensor | None = None


@dataclass
class LoRAMetadata:
    """Which rows use which adapter slot. Built once per step by the runner.

    Invariant: rows are ordered by adapter slot, so each adapter's rows are one contiguous run
    (the one encoding). ``ranges`` lists the runs on the host as ``(slot, start, end)``, slot >= 0
    only (the CPU path); ``slot_runs`` holds the same runs on the device in a fixed shape,
    ``[2, max_loras]`` = (start, count) per slot, count 0 for a slot absent from the step (GPU
    only, vLLM's ``LoRAKernelMeta``): a CUDA graph captured with it replays for any mix of adapters.
    """

    ranges: list[tuple[int, int, int]]  # host-side (slot, start, end), by slot
    max_rank: int  # largest rank among the slots in this batch
    max_rows: int  # the longest run, or a bound of it (a CUDA graph: its padded batch)
    slot_runs: torch.Tensor | None = None  # [2, max_loras] int32 (start, count); None on CPU
    active_slots: int | None = None  # slots with rows (None: unknown, a graph)
    native: bool = False  # CPU: decode rows through the C++ SGMV op (kernels/cpu_native.py)
    # Layouts derived from the above by the first layer that needs them, reused by every other
    # layer of the step (the CPU LoRA plan, ``layers/lora.py``).
    derived: dict[str, Any] = field(default_factory=dict)


def lora_ranges(runs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(slot, start, end)`` per adapter from ``(slot, rows)`` per sequence in row order, rows
    sorted by slot (slot -1: no adapter, skipped)."""
    ranges: list[tuple[int, int, int]] = []
    row = 0
    for slot, n in runs:
        if slot >= 0:
            if ranges and ranges[-1][0] == slot and ranges[-1][2] == row:
                ranges[-1] = (slot, ranges[-1][1], row + n)
            else:
                if ranges and ranges[-1][0] >= slot:
                    raise ValueError(f"LoRA rows not ordered by slot: slot {slot} after {ranges[-1][0]}")
                ranges.append((slot, row, row + n))
        row += n
    return ranges


def to_device(x: Any, device: torch.device | str | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host data (a list, a numpy array, a CPU tensor) as a tensor on ``device`` without waiting
    for the device: on CUDA a pinned staging copy and a non-blocking transfer (``.to("cuda")`` or
    ``torch.tensor(..., device="cuda")`` from pageable memory synchronizes the stream, which makes
    the host wait for every kernel queued before: under async scheduling, the step in flight).
    The caching host allocator keeps the staging block until its copy is done. Elsewhere the data
    as a tensor (numpy arrays and CPU tensors are not copied)."""
    t = torch.as_tensor(x, dtype=dtype)
    dev = torch.device(device) if device is not None else t.device
    if dev.type != "cuda":
        return t if t.device == dev else t.to(dev)
    if t.device.type != "cpu":  # already on a device: no staging
        return t.to(dev, non_blocking=True)
    return t.pin_memory().to(dev, non_blocking=True)


def slot_runs(
    ranges: list[tuple[int, int, int]], max_loras: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """``[2, max_loras]`` int32 (start, count) per slot from ``ranges`` (absent slots: 0, 0)."""
    runs = [[0] * max_loras, [0] * max_loras]
    for slot, start, end in ranges:
        runs[0][slot], runs[1][slot] = start, end - start
    return to_device(runs, device, torch.int32)


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    lora: LoRAMetadata | None = None
    # Per layer: (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim].
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # Per layer FP8 KV scales (1.0 for unquantized caches).
    k_scales: list[float] = field(default_factory=list)
    v_scales: list[float] = field(default_factory=list)
