"""LoRA weights on the device: per-linear slot buffers and the per-slot rank table.

Each LoRA-capable ``Linear`` gets a ``LoRASlots``: per slice (q/k/v, gate/up, ...) an A buffer
``[max_loras, max_rank, in]`` and a B buffer ``[max_loras, out_slice, max_rank]`` (scaling folded
into B), allocated the first time an adapter targets that slice. Ranks below ``max_rank`` are
zero-padded in storage but the kernels compute only up to each slot's true rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lorastar.kernels.lora import add_lora

if TYPE_CHECKING:
    from lorastar.models.context import LoRAMetadata
    from lorastar.models.linear import Linear

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRASlots:
    def __init__(self, layer: Linear, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layer = layer
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        n = len(layer.slice_names)
        self.a: list[torch.Tensor | None] = [None] * n  # per slice [S, R, in]
        self.b: list[torch.Tensor | None] = [None] * n  # per slice [S, N_i, R]
        self.offsets = layer.slice_offsets()[:-1]

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter's A ``[r, in]`` / B ``[out, r]`` per module name into ``slot``."""
        for i, name in enumerate(self.layer.slice_names):
            w = weights.get(name)
            if w is None:
                if self.a[i] is not None:
                    self.a[i][slot].zero_()
                    self.b[i][slot].zero_()  # type: ignore[index]
                continue
            if self.a[i] is None:
                self.a[i] = torch.zeros(
                    self.max_loras, self.max_rank, self.layer.input_size, dtype=self.dtype, device=self.device
                )
                self.b[i] = torch.zeros(
                    self.max_loras, self.layer.output_sizes[i], self.max_rank, dtype=self.dtype, device=self.device
                )
            a, b = w
            r = a.shape[0]
            self.a[i][slot].zero_()
            self.a[i][slot, :r].copy_(a)
            self.b[i][slot].zero_()  # type: ignore[index]
            self.b[i][slot, :, :r].copy_(b)  # type: ignore[index]

    def clear_slot(self, slot: int) -> None:
        self.set_slot(slot, {})

    def apply(self, x: torch.Tensor, y: torch.Tensor, meta: LoRAMetadata) -> None:
        add_lora(y, x, self.a, self.b, meta, self.offsets)


class LoRADeviceState:
    """All LoRA slot buffers of a model plus which adapter (content hash) sits in which slot."""

    def __init__(
        self, linears: dict[str, Linear], max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.max_loras = max_loras
        self.device = device
        self.slots: list[tuple[int, LoRASlots]] = []  # (layer index, slots of one linear)
        for prefix, lin in linears.items():
            lin.lora = LoRASlots(lin, max_loras, max_rank, dtype, device)
            self.slots.append((int(prefix.split(".")[2]), lin.lora))
        self.ranks = torch.zeros(max_loras, dtype=torch.int32, device=device)  # [max_loras]
        self.ranks_host = [0] * max_loras
        self.slot_key: list[str | None] = [None] * max_loras

    def load_slot(self, slot: int, key: str, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Upload an adapter (``(layer, module) -> (A [r, in], B [out, r] scaled)``) into ``slot``;
        linears it does not target get their slot zeroed."""
        for layer_idx, lora in self.slots:
            lora.set_slot(slot, {
                name: (w[0].to(self.device, lora.dtype), w[1].to(self.device, lora.dtype))
                for name in lora.layer.slice_names
                if (w := weights.get((layer_idx, name))) is not None
            })  # fmt: skip
        rank = max((a.shape[0] for a, _ in weights.values()), default=0)
        self.ranks_host[slot] = rank
        self.ranks[slot] = rank
        self.slot_key[slot] = key

    def clear_slot(self, slot: int) -> None:
        self.load_slot(slot, "", {})
        self.slot_key[slot] = None
