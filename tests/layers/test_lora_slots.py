"""The two LoRA slot implementations store the same adapters and add the same deltas (the GPU one
runs here through the punica ops' torch forms on CPU tensors, and interpreted Triton)."""

from __future__ import annotations

import pytest
import torch

import lorastar.kernels.lora as lora_kernels
from lorastar.forward_context import LoRAMetadata
from lorastar.layers.linear import Linear
from lorastar.layers.lora import CpuLoRASlots, GpuLoRASlots


@pytest.mark.parametrize("is_decode", [False, True])  # SGMV segments / BGMV gather
@pytest.mark.parametrize("triton", [False, True])
def test_cpu_and_gpu_slots_agree(triton: bool, is_decode: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lora_kernels, "FORCE_TRITON", triton)  # the punica kernels, interpreted
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
    token_slots = [0, 0, 1, 2, 2, -1]  # rows in slot order, as the runner builds them
    meta = LoRAMetadata(
        token_slots=torch.tensor(token_slots, dtype=torch.int32),
        seg_starts=torch.tensor([0, 2, 3, 5, 6], dtype=torch.int32),
        seg_slots=torch.tensor([0, 1, 2, -1], dtype=torch.int32),
        ranks=torch.tensor([4, 8, 2], dtype=torch.int32),
        max_rank=8,
        ranges=[(0, 0, 2), (1, 2, 3), (2, 3, 5)],
        is_decode=is_decode,
    )
    x = torch.randn(6, 16, generator=gen)
    ys = []
    for s in slots:
        y = torch.zeros(6, 16)
        s.apply(x, y, meta)
        ys.append(y)
    torch.testing.assert_close(ys[0], ys[1])
    assert ys[0][5].abs().sum() == 0 and ys[0][2, :8].abs().sum() == 0  # no adapter / slot 1 lost q
    assert ys[0].abs().sum() > 0
