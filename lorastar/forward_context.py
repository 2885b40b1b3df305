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


def padded_block_tables(tables: list[list[int]], fill: int = 0) -> torch.Tensor:
    """``[B, max_len]`` int32 host tensor of the block tables, short rows padded with ``fill``
    (one tensor built from lists: no per-row tensor on the step's hot path)."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [fill] * (width - len(t)) for t in tables], dtype=torch.int32)


@dataclass
class LoRAMetadata:
    """Which adapter slot each token uses. Built once per step by the runner.

    Invariant: the batch is ordered by adapter slot, so each adapter's tokens are one contiguous
    run. ``ranges`` lists them as ``(slot, start, end)`` (slot >= 0 only; the CPU path indexes rows
    with it); ``seg_starts``/``seg_slots`` are the same runs as tensors (-1 = no adapter; punica
    SGMV); ``token_slots[t]`` is token ``t``'s slot or -1 (punica BGMV, decode). ``ranks[slot]`` is
    the adapter's true rank, so kernels never compute over the padding.
    """

    token_slots: torch.Tensor  # [num_tokens] int32
    seg_starts: torch.Tensor  # [num_segments + 1] int32
    seg_slots: torch.Tensor  # [num_segments] int32
    ranks: torch.Tensor  # [max_loras] int32
    max_rank: int  # largest rank among the slots in this batch
    is_decode: bool = False  # every sequence contributes one token
    force_bgmv: bool = False  # CUDA graphs: the gather form whatever the batch (no segment data)
    native: bool = False  # CPU: decode rows through the C++ SGMV op (kernels/cpu_native.py)
    ranges: list[tuple[int, int, int]] = field(default_factory=list)  # host-side (slot, start, end)
    # Layouts derived from the above by the first layer that needs them, reused by every other
    # layer of the step (the CPU LoRA plan, ``layers/lora.py``).
    derived: dict[str, Any] = field(default_factory=dict)


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    lora: LoRAMetadata | None = None
    # Per layer: (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim].
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # Per layer FP8 KV scales (1.0 for unquantized caches).
    k_scales: list[float] = field(default_factory=list)
    v_scales: list[float] = field(default_factory=list)
