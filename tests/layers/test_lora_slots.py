"""The two LoRA slot implementations store the same adapters and add the same deltas (the GPU one
through the Triton kernels, interpreted on CPU), for a step's rows sorted by slot and for a CUDA
graph's fixed grid over the whole batch."""

from __future__ import annotations

import pytest
import torch

from lorastar.forward_context import LoRAMetadata, lora_ranges, slot_runs
from lorastar.layers.linear import Linear
from lorastar.layers.lora import CpuLoRASlots, GpuLoRASlots


@pytest.mark.parametrize("graph_grid", [False, True])
def test_cpu_and_gpu_slots_agree(graph_grid: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    layer = Linear(
        16, [8, 4, 4], bias=False, prefix="qkv", slice_names=["q", "k", "v"], params_dtype=torch.float32
    )
    slots = [cls(layer, 3, 8, torch.float32, torch.device("cpu")) for cls in (CpuLoRASlots, GpuLoRASlots)]
    adapters = {  # slot -> targeted slices at that slot's rank; slot 1 is rewritten with fewer slices
        0: {"q": 4, "v": 4},
        1: {"q": 8, "k": 8, "v": 8},
        2: {"k": 2},
    }
    for slot, mods in adapters.items():
        w = {
            m: (
                torch.randn(r, 16, generator=gen),
                torch.randn(layer.output_sizes["qkv".index(m)], r, generator=gen),
            )
            for m, r in mods.items()
        }
        for s in slots:
            s.set_slot(slot, w)
    w = {"k": (torch.randn(8, 16, generator=gen), torch.randn(4, 8, generator=gen))}
    for s in slots:
        s.set_slot(1, w)  # the old q/v of slot 1 must be gone
    ranges = lora_ranges([(-1, 1), (0, 2), (1, 1), (2, 2)])  # rows in slot order, as the runner builds them
    assert ranges == [(0, 1, 3), (1, 3, 4), (2, 4, 6)]
    meta = LoRAMetadata(
        ranges=ranges, max_rank=8, max_rows=6 if graph_grid else 2, slot_runs=slot_runs(ranges, 3)
    )
    x = torch.randn(6, 16, generator=gen)
    ys = []
    for s in slots:
        y = torch.zeros(6, 16)
        s.apply(x, y, meta)
        ys.append(y)
    torch.testing.assert_close(ys[0], ys[1])
    assert ys[0][0].abs().sum() == 0 and ys[0][3, :8].abs().sum() == 0  # no adapter / slot 1 lost q
    assert ys[0].abs().sum() > 0
    gpu = slots[1]
    assert isinstance(gpu, GpuLoRASlots)
    assert gpu.ranks.tolist() == [[4, 0, 4], [0, 8, 0], [0, 2, 0]]  # the kernels skip the zeros


def test_lora_ranges_rejects_unsorted_rows() -> None:
    assert lora_ranges([(0, 2), (0, 1), (-1, 3), (2, 1)]) == [(0, 0, 3), (2, 6, 7)]
    with pytest.raises(ValueError, match="not ordered by slot"):
        lora_ranges([(1, 1), (0, 1)])
