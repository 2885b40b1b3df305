"""LoRA on the device: per-linear slot buffers, the per-slot rank table, and a fused linear's
LoRA entry points (``add_lora`` on GPU: punica kernels; ``add_lora_packed`` on CPU).

Each LoRA-capable ``Linear`` gets a ``LoRASlots``, one implementation per device (``GpuLoRASlots``,
``CpuLoRASlots``): per slice (q/k/v, gate/up, ...) an A buffer ``[max_loras, max_rank, in]``
(packed across slices on CPU) and a B buffer
``[max_loras, out_slice, max_rank]`` (scaling folded into B), allocated the first time an adapter
targets that slice. Ranks below ``max_rank`` are zero-padded in storage but the kernels compute
only up to each slot's true rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from lorastar.forward_context import LoRAMetadata
from lorastar.kernels.lora import (
    bgmv_expand,
    bgmv_shrink,
    sgmv_expand,
    sgmv_shrink,
)

if TYPE_CHECKING:
    from lorastar.layers.linear import Linear


class LoRASlots(ABC):
    """One linear's adapter slots: B per slice ``[S, N_i, R]`` (allocated the first time an adapter
    targets the slice), each slot's targeted slices and rank. Subclasses store A for their device."""

    def __init__(
        self, layer: Linear, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.layer = layer
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.b: list[torch.Tensor | None] = [None] * len(layer.slice_names)  # per slice [S, N_i, R]
        self.slot_slices: list[list[int]] = [[] for _ in range(max_loras)]  # slices each slot targets
        self.slot_ranks = [0] * max_loras  # each slot's rank in this linear
        # Slots whose slices share one A (a LoRA on the fused module, Phi-3): the CPU path shrinks once.
        self.slot_shared_a = [False] * max_loras
        self.offsets = layer.slice_offsets()[:-1]

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.dtype, device=self.device)

    def set_slot(
        self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], *, shared_a: bool = False
    ) -> None:
        """Write an adapter's A ``[r, in]`` / B ``[out, r]`` per module name into ``slot``
        (modules of lower rank than the slot's are zero-padded to it). ``shared_a``: every slice has
        the same A (a LoRA on the fused module), stored once where the layout allows."""
        names = self.layer.slice_names
        rank = max((a.shape[0] for a, _ in weights.values()), default=0)
        slices = [i for i, name in enumerate(names) if name in weights]
        for b in self.b:
            if b is not None:
                b[slot].zero_()
        self._clear_a(slot)
        for j, i in enumerate(slices):
            a, b = weights[names[i]]
            if self.b[i] is None:
                self.b[i] = self._zeros(self.max_loras, self.layer.output_sizes[i], self.max_rank)
            self._write_a(slot, i, 0 if shared_a else j, rank, a)
            self.b[i][slot, :, : b.shape[1]].copy_(b)  # type: ignore[index]
        self.slot_slices[slot] = slices
        self.slot_ranks[slot] = rank
        self.slot_shared_a[slot] = shared_a

    @abstractmethod
    def _clear_a(self, slot: int) -> None:
        """Zero ``slot``'s A in every allocated buffer."""

    @abstractmethod
    def _write_a(self, slot: int, i: int, j: int, rank: int, a: torch.Tensor) -> None:
        """Store A ``[r, in]`` of slice ``i``, the ``j``-th slice the slot targets (slot rank ``rank``)."""

    @abstractmethod
    def apply(self, x: torch.Tensor, y: torch.Tensor, meta: LoRAMetadata) -> None:
        """Add each row's adapter delta for ``x [T, in]`` into ``y [T, out]`` in place."""


class GpuLoRASlots(LoRASlots):
    """Per-slice A ``[S, R, in]`` for the punica kernels (``add_lora``)."""

    def __init__(
        self, layer: Linear, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(layer, max_loras, max_rank, dtype, device)
        self.a: list[torch.Tensor | None] = [None] * len(layer.slice_names)  # per slice [S, R, in]

    def _clear_a(self, slot: int) -> None:
        for a in self.a:
            if a is not None:
                a[slot].zero_()

    def _write_a(self, slot: int, i: int, j: int, rank: int, a: torch.Tensor) -> None:
        if self.a[i] is None:
            self.a[i] = self._zeros(self.max_loras, self.max_rank, self.layer.input_size)
        self.a[i][slot, : a.shape[0]].copy_(a)  # type: ignore[index]

    def apply(self, x: torch.Tensor, y: torch.Tensor, meta: LoRAMetadata) -> None:
        add_lora(y, x, self.a, self.b, meta, self.offsets)


class CpuLoRASlots(LoRASlots):
    """One packed A per slot (``a_packed [S, P * R, in]``: the slices the slot targets, at the slot's
    rank, back to back), so each adapter costs one shrink matmul for all of q/k/v or gate/up."""

    def __init__(
        self, layer: Linear, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(layer, max_loras, max_rank, dtype, device)
        self.a_packed: torch.Tensor | None = None  # [S, P * R, in]

    def _clear_a(self, slot: int) -> None:
        if self.a_packed is not None:
            self.a_packed[slot].zero_()

    def _write_a(self, slot: int, i: int, j: int, rank: int, a: torch.Tensor) -> None:
        if self.a_packed is None:
            n = len(self.layer.slice_names)
            self.a_packed = self._zeros(self.max_loras, n * self.max_rank, self.layer.input_size)
        self.a_packed[slot, j * rank : j * rank + a.shape[0]].copy_(a)

    def apply(self, x: torch.Tensor, y: torch.Tensor, meta: LoRAMetadata) -> None:
        if self.a_packed is not None:  # else no adapter targets this linear
            add_lora_packed(
                y, x, self.a_packed, self.b, self.slot_slices, self.slot_ranks, meta, self.offsets,
                self.slot_shared_a,
            )  # fmt: skip


class LoRADeviceState:
    """All LoRA slot buffers of a model plus which adapter (content hash) sits in which slot."""

    def __init__(
        self,
        linears: dict[str, Linear],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_loras = max_loras
        self.device = device
        self.slots: list[tuple[int, LoRASlots]] = []  # (layer index, slots of one linear)
        slots_cls = CpuLoRASlots if device.type == "cpu" else GpuLoRASlots
        for prefix, lin in linears.items():
            lin.lora = slots_cls(lin, max_loras, max_rank, dtype, device)
            self.slots.append((int(prefix.split(".")[2]), lin.lora))
        self.ranks = torch.zeros(max_loras, dtype=torch.int32, device=device)  # [max_loras]
        self.ranks_host = [0] * max_loras
        self.max_rank = max_rank
        # Bumped when an upload allocates a slice buffer: captured CUDA graphs that skipped the
        # slice (no buffer then) are stale.
        self.layout_version = 0

    def load_slot(
        self, slot: int, key: str, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Upload an adapter (``(layer, module) -> (A [r, in], B [out, r] scaled)``) into ``slot``;
        linears it does not target get their slot zeroed. ``key`` (the content hash) is the
        registry's record, not kept here."""
        allocated = self._num_buffers()
        for layer_idx, lora in self.slots:
            per_slice = {name: w for name in lora.layer.slice_names if (w := weights.get((layer_idx, name)))}
            fused = weights.get((layer_idx, lora.layer.prefix.rpartition(".")[2]))
            if fused is not None and len(lora.layer.slice_names) > 1:
                # A LoRA on the fused module (Phi-3's qkv_proj): one A for every slice, B split by rows.
                a, b = fused
                per_slice = dict(
                    zip(lora.layer.slice_names, ((a, p) for p in b.split(lora.layer.output_sizes)))
                )
            lora.set_slot(slot, {
                name: (a.to(self.device, lora.dtype), b.to(self.device, lora.dtype))
                for name, (a, b) in per_slice.items()
            }, shared_a=fused is not None and len(lora.layer.slice_names) > 1)  # fmt: skip
        rank = max((a.shape[0] for a, _ in weights.values()), default=0)
        self.ranks_host[slot] = rank
        self.ranks[slot] = rank
        if self._num_buffers() != allocated:
            self.layout_version += 1

    def _num_buffers(self) -> int:
        return sum(b is not None for _, lora in self.slots for b in lora.b)


def add_lora_packed(
    y: torch.Tensor,
    x: torch.Tensor,
    a_packed: torch.Tensor,
    lora_b_slices: list[torch.Tensor | None],
    slot_slices: list[list[int]],
    slot_ranks: list[int],
    meta: LoRAMetadata,
    offsets: list[int],
    slot_shared_a: list[bool] | None = None,
) -> None:
    """CPU path over a fused linear: one shrink per adapter for all its slices, then one expand
    per slice written into ``y`` (plain views: the rows of one adapter are contiguous).

    Semantics: ``for slot, s, e in meta.ranges: t = x[rows] @ Ap[slot, :P*r].T; for j, i in enumerate(slices[slot]): y[rows, off_i:off_i+N_i] += t[:, j*r:(j+1)*r] @ B_i[slot, :, :r].T``

    Args:
        y: ``[T, Ntot]`` base output, updated in place.
        x: ``[T, H]`` layer input.
        a_packed: ``[S, P_max * R, H]``: slot ``s`` holds the A of each slice it targets
            (``slot_slices[s]``), ``slot_ranks[s]`` rows each, back to back.
        lora_b_slices: per slice ``[S, N_i, R]`` (scaling folded in) or ``None``.
        slot_slices / slot_ranks: per slot, the slices packed in ``a_packed`` and their rank.
        meta: ``meta.ranges``, the contiguous rows of each slot.
        offsets: first column of each slice in ``y``.
        slot_shared_a: per slot, whether all its slices share the one A packed first (fused-module
            LoRA): one shrink of width ``r`` serves every slice.
    """
    if x.shape[0] == 0:
        return
    for slot, s, e in meta.ranges:
        r, slices = slot_ranks[slot], slot_slices[slot]
        if r == 0 or not slices or e <= s:
            continue
        shared = slot_shared_a is not None and slot_shared_a[slot]
        t = x[s:e] @ a_packed[slot, : r if shared else len(slices) * r].t()  # [n, P * r] ([n, r] shared)
        for j, i in enumerate(slices):
            if shared:
                j = 0  # noqa: PLW2901 - every slice reads the one shrink
            b, off = lora_b_slices[i], offsets[i]
            if b is None:  # cannot happen for a packed slice; keeps the types honest
                continue
            y[s:e, off : off + b.shape[1]].addmm_(t[:, j * r : (j + 1) * r], b[slot, :, :r].t())


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_slices: list[torch.Tensor | None],
    lora_b_slices: list[torch.Tensor | None],
    meta: LoRAMetadata,
    offsets: list[int],
    *,
    force_triton: bool = False,
) -> None:
    """GPU path: add every slice's LoRA delta to a fused linear's output (q/k/v or gate/up slices)
    with the punica kernels (on CPU tensors they fall back to their torch forms; the engine's CPU
    path is ``add_lora_packed``).

    Semantics: ``for i: if A[i] is not None: y[:, offsets[i]:offsets[i]+N_i] += (x @ A[i][slot].T) @ B[i][slot].T``
    per token with its slot (``meta.token_slots``; -1 rows untouched), at the slot's true rank.

    Args:
        y: ``[T, Ntot]`` base output, updated in place.
        x: ``[T, H]`` layer input.
        lora_a_slices: per slice ``[S, R, H]`` or ``None`` (no adapter targets that slice).
        lora_b_slices: per slice ``[S, N_i, R]`` (scaling folded in by the caller).
        meta: the step's ``LoRAMetadata`` (BGMV when ``meta.is_decode``, SGMV otherwise).
        offsets: first column of each slice in ``y``.
    """
    if x.shape[0] == 0:
        return
    # Decode rows sorted by adapter form few long segments: SGMV's tensor-core tiles then beat
    # one GEMV per token. Shapes only (no device sync): tokens vs number of segments.
    num_segments = meta.seg_slots.shape[0]
    use_bgmv = meta.force_bgmv or (meta.is_decode and (x.shape[0] < 16 or 4 * num_segments > x.shape[0]))
    live = [
        (a, b, off)
        for a, b, off in zip(lora_a_slices, lora_b_slices, offsets)
        if a is not None and b is not None
    ]
    if not live:
        return
    # One fp32 intermediate for all slices (column block per slice): split-K shrink accumulates
    # with atomics, and rounding stays out of it.
    cols = [0]
    for a, _, _ in live:
        cols.append(cols[-1] + a.shape[1])
    buf_all = torch.zeros(x.shape[0], cols[-1], dtype=torch.float32, device=x.device)  # [T, P * R]
    for k, (a, b, off) in enumerate(live):
        buf = buf_all[:, cols[k] : cols[k + 1]]  # [T, R] view
        if use_bgmv:
            bgmv_shrink(x, a, buf, meta.token_slots, meta.ranks, 1.0, force_triton=force_triton)
            bgmv_expand(buf, b, y, meta.token_slots, meta.ranks, off, force_triton=force_triton)
        else:
            sgmv_shrink(
                x, a, buf, meta.seg_starts, meta.seg_slots, meta.ranks, 1.0, force_triton=force_triton
            )
            sgmv_expand(
                buf, b, y, meta.seg_starts, meta.seg_slots, meta.ranks, off, force_triton=force_triton
            )
