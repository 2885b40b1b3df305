"""The two LoRA slot implementations store the same adapters and add the same deltas (the GPU one
through the Triton kernels, interpreted on CPU), for a step's rows sorted by slot and for a CUDA
graph's fixed grid over the whole batch."""

from __future__ import annotations

import pytest
import torch

from lorastar.forward_context import LoRAMetadata, lora_ranges, slot_runs
from lorastar.layers.linear import Linear
from lorastar.layers.lora import CpuLoRASlots, GpuLoRASlots


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("graph_grid", [False, True])
def test_cpu_and_gpu_slots_agree(graph_grid: bool, compact: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import lorastar.kernels.lora as lora_kernels

    monkeypatch.setattr(lora_kernels, "EXPAND_COMPACT_GRID", compact)
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


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("graph_grid", [False, True])
def test_stacked_shrink_in_the_base_gemm(
    graph_grid: bool, compact: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stacked slots: the linear's weight and bias become views of ``[W; A]`` / ``[bias; 0]``
    with their values unchanged, and ``fused_forward`` (one GEMM, one expand) equals the base
    output plus ``apply``'s deltas of unstacked slots; ``None`` where it does not apply. The
    expand on either grid (``compact``: ``EXPAND_COMPACT_GRID``)."""
    import lorastar.kernels.lora as lora_kernels
    import lorastar.layers.lora as lora_layers

    gen = torch.Generator().manual_seed(1)

    def layer() -> Linear:
        lin = Linear(16, [8, 4, 4], bias=True, prefix="layers.0.qkv_proj", slice_names=["q", "k", "v"],
                     params_dtype=torch.float32)  # fmt: skip
        torch.manual_seed(0)
        lin.weight.data.normal_()
        lin.bias.data.normal_()  # type: ignore[union-attr]
        return lin

    plain, stacked_layer = layer(), layer()
    w0, b0 = stacked_layer.weight.detach().clone(), stacked_layer.bias.detach().clone()  # type: ignore[union-attr]
    monkeypatch.setattr(lora_layers, "STACKED_MAX_BYTES", 0)
    separate = GpuLoRASlots(plain, 3, 8, torch.float32, torch.device("cpu"))
    monkeypatch.undo()
    monkeypatch.setattr(lora_kernels, "EXPAND_COMPACT_GRID", compact)
    stacked = GpuLoRASlots(stacked_layer, 3, 8, torch.float32, torch.device("cpu"))
    assert separate.stacked is None and stacked.stacked is not None
    assert stacked_layer.weight.data_ptr() == stacked.stacked.data_ptr()
    assert torch.equal(stacked_layer.weight, w0) and torch.equal(stacked_layer.bias, b0)  # type: ignore[arg-type]
    x = torch.randn(6, 16, generator=gen)
    ranges = lora_ranges([(-1, 1), (0, 2), (2, 3)])
    meta = LoRAMetadata(
        ranges=ranges, max_rank=8, max_rows=6 if graph_grid else 3, slot_runs=slot_runs(ranges, 3)
    )
    assert stacked.fused_forward(x, meta) is None  # no adapter written yet: the plain GEMM
    for slot, mods in {0: {"q": 4, "v": 8}, 2: {"k": 8, "q": 2}}.items():
        w = {m: (torch.randn(r, 16, generator=gen), torch.randn(plain.output_sizes["qkv".index(m)], r, generator=gen))
             for m, r in mods.items()}  # fmt: skip
        separate.set_slot(slot, w)
        stacked.set_slot(slot, w)
    want = plain(x)
    separate.apply(x, want, meta)
    got = stacked.fused_forward(x, meta)
    assert got is not None and got.shape == (6, 16)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got[0], x[0] @ w0.T + b0)  # the row of no adapter: base only
    assert (got[1:] - (x[1:] @ w0.T + b0)).abs().amax(dim=1).gt(1e-3).all()  # every adapter row moved
    assert separate.fused_forward(x, meta) is None
    big = torch.randn(lora_layers.STACKED_MAX_ROWS + 1, 16)
    assert stacked.fused_forward(big, meta) is None  # prefill-sized: the separate shrink


def test_stacked_whatever_the_device_index() -> None:
    """The engine names its device without an index (``cuda``) while the weights report one
    (``cuda:0``): stacking compares device types (an exact comparison left the GPU unstacked)."""
    lin = Linear(16, [8], bias=False, prefix="layers.0.o_proj", slice_names=["o"], params_dtype=torch.float32)
    assert lin.weight.device != torch.device("cpu", 0)
    slots = GpuLoRASlots(lin, 2, 4, torch.float32, torch.device("cpu", 0))
    assert slots.stacked is not None and lin.weight.data_ptr() == slots.stacked.data_ptr()
