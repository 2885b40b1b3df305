"""LoRA on the device: per-linear slot buffers and the entry points that add a fused linear's
adapter deltas (``GpuLoRASlots.apply``: the punica kernels; ``add_lora_cpu`` on CPU).

Each LoRA-capable ``Linear`` gets a ``LoRASlots``, one implementation per device. On GPU all
slices (q/k/v, gate/up, ...) share one A ``[max_loras, P * max_rank, in]`` and one B
``[max_loras, out, max_rank]`` buffer, so one shrink and one expand launch cover the linear (on an
unquantized base, A sits under the base weight and steps of few rows fold the shrink into the
base GEMM: one GEMM and one expand, ``STACKED_MAX_BYTES``); on CPU
each slice has its own A ``[max_loras, max_rank, in]`` and B transposed
``[max_loras, max_rank, out_slice]``. Ranks below ``max_rank`` are zero-padded in storage but every
path computes only up to each slot's true rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lorastar.forward_context import LoRAMetadata, to_device
from lorastar.kernels._triton import HAS_TRITON
from lorastar.kernels.cpu_native import lora_segments
from lorastar.kernels.lora import lora_expand, lora_shrink
from lorastar.layers.linear import UnquantizedLinearMethod

if TYPE_CHECKING:
    from lorastar.layers.linear import Linear


class LoRASlots(ABC):
    """One linear's adapter slots: which slices each slot targets, at which rank. Subclasses store
    the weights in their device's layout."""

    reads_slot_runs = False  # whether ``apply`` needs ``LoRAMetadata.slot_runs`` (device tensors)

    def __init__(
        self, layer: Linear, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        # The linear's shape, not the linear: it holds this object, and a cycle would keep both
        # (and the model's weights) alive past the engine until a cyclic GC.
        self.slice_names: list[str] = list(layer.slice_names)
        self.module = layer.prefix.rpartition(".")[2]  # the fused module's name (qkv_proj)
        self.input_size = layer.input_size
        self.output_sizes: list[int] = list(layer.output_sizes)
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.slot_slices: list[list[int]] = [[] for _ in range(max_loras)]  # slices each slot targets
        self.slot_ranks = [0] * max_loras  # each slot's rank in this linear
        # Slots whose slices share one A (a LoRA on the fused module, Phi-3): the CPU path shrinks once
        # (the A is still written into every slice's buffer).
        self.slot_shared_a = [False] * max_loras
        self.offsets = layer.slice_offsets()[:-1]

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.dtype, device=self.device)

    def set_slot(
        self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], *, shared_a: bool = False
    ) -> None:
        """Write an adapter's A ``[r, in]`` / B ``[out, r]`` per module name into ``slot``
        (everything the slot held before is zeroed). ``shared_a``: every slice has the same A (a
        LoRA on the fused module), so one shrink serves them all."""
        names = self.slice_names
        slices = [i for i, name in enumerate(names) if name in weights]
        self._clear(slot)
        for i in slices:
            self._write(slot, i, *weights[names[i]])
        self.slot_slices[slot] = slices
        self.slot_ranks[slot] = max((a.shape[0] for a, _ in weights.values()), default=0)
        self.slot_shared_a[slot] = shared_a

    @property
    @abstractmethod
    def num_buffers(self) -> int:
        """Weight buffers allocated so far (a new one makes captured CUDA graphs stale)."""

    @abstractmethod
    def _clear(self, slot: int) -> None:
        """Zero everything ``slot`` holds."""

    @abstractmethod
    def _write(self, slot: int, i: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Store slice ``i``'s A ``[r, in]`` and B ``[N_i, r]`` (scaled) in ``slot``."""

    @abstractmethod
    def apply(self, x: torch.Tensor, y: torch.Tensor, meta: LoRAMetadata) -> None:
        """Add each row's adapter delta for ``x [T, in]`` into ``y [T, out]`` in place."""

    def fused_forward(self, x: torch.Tensor, meta: LoRAMetadata) -> torch.Tensor | None:
        """The linear's whole output, base and deltas, where these slots compute it in fewer
        launches than the base GEMM followed by ``apply``; ``None``: not here."""
        return None


# A linear's shrink rides in its base GEMM (every slot's A rows stacked under the weight: one
# ``x @ [W; A].T``, then one expand) when those rows take at most STACKED_MAX_BYTES and a step at
# most STACKED_MAX_ROWS rows. lora_graph_step.py, H100, the 88 linears of a 1.1B Llama with 16
# slots of rank 16 in one CUDA graph: LoRA 625 vs 1220 us per step at 64 rows, 398 vs 774 us at one
# row; end to end (gpu_throughput.py --unstacked) 1.21x / 1.18x the tokens/s with 16 adapters at
# 64 requests / one request, LoRA tax 0.79 / 0.81 vs 0.65 / 0.69. The launch it saves costs ~4-7 us
# per linear, the time to read ~13-20 MB; the stacked rows of idle slots are read as well, hence
# the bound on their size. Past STACKED_MAX_ROWS the GEMM is no longer bound by reading weights
# and every row times every slot's A costs FLOPs.
STACKED_MAX_BYTES = 8 << 20
STACKED_MAX_ROWS = 256


def _stackable(layer: Linear, rows: int, dtype: torch.dtype, device: torch.device) -> bool:
    w = getattr(layer, "weight", None)
    return (
        isinstance(layer.quant_method, UnquantizedLinearMethod)
        and layer.weight_packed is None
        and isinstance(w, torch.Tensor)
        and w.dtype == dtype
        and w.device.type == device.type
        and rows * layer.input_size * w.element_size() <= STACKED_MAX_BYTES
    )


class GpuLoRASlots(LoRASlots):
    """All slices of the linear in one buffer each, so one shrink and one expand launch cover it
    (``kernels/lora.py``): A ``[S, P * R, in]`` (slice ``i`` in rows ``i * R ..``), B
    ``[S, Ntot, R]`` (slice ``i`` in the rows of its output columns) and ``ranks [S, P]`` (each
    slot's true rank per slice, 0 where it targets none; the kernels skip those). Allocated whole
    the first time an adapter targets the linear: a slice no adapter targets costs memory (vLLM
    allocates every slice too) but no compute. The buffers never move, so captured CUDA graphs
    read hot-loaded adapters at replay.

    Stacked (``_stackable``): A is allocated with the slots, as the rows under the base weight of
    one ``[N + S * P * R, in]`` tensor, and the linear's weight (and bias) become views of it, so
    ``fused_forward`` computes the base output and every slot's shrink in one GEMM. A then takes its
    memory from the start, targeted or not (vLLM allocates every slice up front as well)."""

    reads_slot_runs = True

    def __init__(
        self, layer: Linear, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(layer, max_loras, max_rank, dtype, device)
        self.a: torch.Tensor | None = None  # [S, P * R, in]
        self.b: torch.Tensor | None = None  # [S, Ntot, R]
        self.ranks = torch.zeros(max_loras, len(layer.slice_names), dtype=torch.int32, device=device)
        self.bounds = torch.tensor(layer.slice_offsets(), dtype=torch.int32, device=device)  # [P + 1]
        self.max_width = max(layer.output_sizes)
        self.widths = list(layer.output_sizes)  # for the expand's compact grid
        self.out_size = sum(layer.output_sizes)
        self.stacked: torch.Tensor | None = None  # [N + S * P * R, in]: W, then every slot's A
        self.stacked_bias: torch.Tensor | None = None  # [N + S * P * R]: the bias, then zeros
        rows = max_loras * len(layer.slice_names) * max_rank
        if _stackable(layer, rows, dtype, device):
            n, w = self.out_size, layer.weight
            self.stacked = torch.zeros(n + rows, layer.input_size, dtype=dtype, device=w.device)
            self.stacked[:n].copy_(w.data)
            w.data = self.stacked[:n]
            self.a = self.stacked[n:].view(max_loras, rows // max_loras, layer.input_size)
            if layer.bias is not None:
                self.stacked_bias = torch.zeros(n + rows, dtype=layer.bias.dtype, device=w.device)
                self.stacked_bias[:n].copy_(layer.bias.data)
                layer.bias.data = self.stacked_bias[:n]

    @property
    def num_buffers(self) -> int:
        return int(self.b is not None)

    def _clear(self, slot: int) -> None:
        for buf in (self.a, self.b):
            if buf is not None:
                buf[slot].zero_()
        self.ranks[slot].zero_()

    def _write(self, slot: int, i: int, a: torch.Tensor, b: torch.Tensor) -> None:
        if self.a is None:
            self.a = self._zeros(self.max_loras, len(self.slice_names) * self.max_rank, self.input_size)
        if self.b is None:
            self.b = self._zeros(self.max_loras, self.out_size, self.max_rank)
        r, lo = a.shape[0], i * self.max_rank
        self.a[slot, lo : lo + r].copy_(a)
        self.b[slot, self.offsets[i] : self.offsets[i] + b.shape[0], :r].copy_(b)
        # fill_ passes r to a kernel; `ranks[slot, i] = r` copied a host scalar and synchronized
        # (an upload with a step in flight held the host; the H200's sync-debug test caught it)
        self.ranks[slot, i].fill_(r)

    def apply(self, x: torch.Tensor, y: torch.Tensor, meta: LoRAMetadata) -> None:
        """Semantics: ``for slot's rows, slice i: y[rows, cols_i] += (x[rows] @ A_i[slot, :r].T) @ B_i[slot, :, :r].T``
        (``r = ranks[slot, i]``; rows of no slot untouched)."""
        if self.a is None or self.b is None or x.shape[0] == 0 or meta.max_rows == 0:
            return
        if meta.slot_runs is None:
            raise ValueError("GPU LoRA needs LoRAMetadata.slot_runs")
        # fp32 intermediate: split-K shrink accumulates with atomics, and rounding stays out of it.
        buf = torch.empty(x.shape[0], self.a.shape[1], dtype=torch.float32, device=x.device)  # [T, P * R]
        lora_shrink(
            x, self.a, buf, meta.slot_runs, self.ranks, max_rows=meta.max_rows, active_slots=meta.active_slots
        )
        lora_expand(
            buf, self.b, y, meta.slot_runs, self.ranks, self.bounds,
            max_rows=meta.max_rows, max_width=self.max_width, widths=self.widths,
        )  # fmt: skip

    def fused_forward(self, x: torch.Tensor, meta: LoRAMetadata) -> torch.Tensor | None:
        """Semantics: ``z = x @ [W; A].T + [bias; 0]; y = z[:, :N]; y[slot's rows, cols_i] += z[rows, N + slot*P*R + i*R :][:r] @ B_i[slot, :, :r].T``
        (``[T, N]``, a view of ``z``); ``None`` unless stacked, an adapter has been written and
        the step has at most ``STACKED_MAX_ROWS`` rows."""
        t = x.shape[0]
        if self.stacked is None or self.a is None or self.b is None or not 0 < t <= STACKED_MAX_ROWS:
            return None
        if meta.slot_runs is None:
            raise ValueError("GPU LoRA needs LoRAMetadata.slot_runs")
        n = self.out_size
        z = F.linear(x, self.stacked, self.stacked_bias)  # [T, N + S * P * R]
        y = z[:, :n]
        if meta.max_rows:
            lora_expand(
                z[:, n:], self.b, y, meta.slot_runs, self.ranks, self.bounds,
                max_rows=meta.max_rows, max_width=self.max_width, slot_cols=self.a.shape[1],
                widths=self.widths,
            )  # fmt: skip
        return y


class CpuLoRASlots(LoRASlots):
    """Per slice, allocated the first time an adapter targets it: A ``[S, R, in]`` and B
    transposed, ``[S, R, out]``: the expand then reads rank ``j``'s row of B.T as one contiguous
    run (a B row ``[R]`` read its first r of R floats, strided). A fused-module LoRA writes its one
    A into every slice. Run by ``add_lora_cpu``."""

    def __init__(
        self, layer: Linear, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(layer, max_loras, max_rank, dtype, device)
        self.a: list[torch.Tensor | None] = [None] * len(layer.slice_names)  # per slice [S, R, in]
        self.b: list[torch.Tensor | None] = [None] * len(layer.slice_names)  # per slice [S, R, N_i]

    @property
    def num_buffers(self) -> int:
        return sum(b is not None for b in self.b)

    def _clear(self, slot: int) -> None:
        for buf in (*self.a, *self.b):
            if buf is not None:
                buf[slot].zero_()

    def _write(self, slot: int, i: int, a: torch.Tensor, b: torch.Tensor) -> None:
        if self.a[i] is None:
            self.a[i] = self._zeros(self.max_loras, self.max_rank, self.input_size)
        if self.b[i] is None:
            self.b[i] = self._zeros(self.max_loras, self.max_rank, self.output_sizes[i])
        self.a[i][slot, : a.shape[0]].copy_(a)  # type: ignore[index]
        self.b[i][slot, : b.shape[1]].copy_(b.t())  # type: ignore[index]

    def apply(self, x: torch.Tensor, y: torch.Tensor, meta: LoRAMetadata) -> None:
        add_lora_cpu(y, x, self.a, self.b, meta, self.offsets, self.slot_ranks, self.slot_shared_a)


def lora_slots_class(device: torch.device) -> type[LoRASlots]:
    """The slot implementation for ``device``: torch matmuls (and the C++ op) on CPU, the Triton
    kernels elsewhere."""
    if device.type == "cpu":
        return CpuLoRASlots
    if not HAS_TRITON:
        raise RuntimeError(f"LoRA on {device.type} needs Triton for its kernels (pip install triton)")
    return GpuLoRASlots


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
        slots_cls = lora_slots_class(device)
        self.reads_slot_runs = slots_cls.reads_slot_runs
        for prefix, lin in linears.items():
            lin.lora = slots_cls(lin, max_loras, max_rank, dtype, device)
            self.slots.append((int(prefix.split(".")[2]), lin.lora))
        self.ranks_host = [0] * max_loras  # each slot's largest rank
        self.max_rank = max_rank
        # Bumped when an upload allocates a slice buffer: captured CUDA graphs that skipped the
        # slice (no buffer then) are stale.
        self.layout_version = 0

    def load_slot(
        self, slot: int, key: str, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Upload an adapter (``(layer, module) -> (A [r, in], B [out, r] scaled)``) into ``slot``;
        linears it does not target get their slot zeroed. ``key`` (the content hash) is the
        registry's record, not kept here. On CUDA the weights go through pinned staging without
        waiting for the device: an adapter swapped in while a step is in flight (async scheduling)
        does not hold the host until that step ends (``.to("cuda")`` from pageable memory did, once
        per tensor). Stream order keeps it safe: the write is queued after every step launched
        before it, the one in flight included (which may still read the evicted adapter's rows)."""
        allocated = self._num_buffers()
        for layer_idx, lora in self.slots:
            per_slice = {name: w for name in lora.slice_names if (w := weights.get((layer_idx, name)))}
            fused = weights.get((layer_idx, lora.module))
            if fused is not None and len(lora.slice_names) > 1:
                # A LoRA on the fused module (Phi-3's qkv_proj): one A for every slice, B split by rows.
                a, b = fused
                per_slice = dict(zip(lora.slice_names, ((a, p) for p in b.split(lora.output_sizes))))
            lora.set_slot(slot, {
                name: (to_device(a, self.device, lora.dtype), to_device(b, self.device, lora.dtype))
                for name, (a, b) in per_slice.items()
            }, shared_a=fused is not None and len(lora.slice_names) > 1)  # fmt: skip
        rank = max((a.shape[0] for a, _ in weights.values()), default=0)
        self.ranks_host[slot] = rank
        if self._num_buffers() != allocated:
            self.layout_version += 1

    def _num_buffers(self) -> int:
        return sum(lora.num_buffers for _, lora in self.slots)


@dataclass
class CpuLoRABatch:
    """Adapters run together at one rank (the step's largest; lower ranks are zero-padded in the
    buffers): group ``g`` is slot ``slot_lo + g`` (a view of the
    buffers' slots ``slot_lo .. slot_lo + G``, idle ones included and ignored) or, when ``slots``
    is set, slot ``slots[g]`` (gathered). ``x_index [G * L]`` picks each group's rows, padded to
    ``L`` with a copy of one of its rows; ``valid [n]`` lists the real entries of the ``G * L``
    grid and ``rows [n]`` their rows in ``y`` (``row_start``: the contiguous rows from there)."""

    x_index: torch.Tensor  # [G * L] int64
    valid: torch.Tensor  # [n] int64
    rows: torch.Tensor | None  # [n] int64, None when row_start is set
    row_start: int | None
    slots: torch.Tensor | None  # [G] int64, or None: groups are slots slot_lo .. slot_lo + G
    slot_lo: int
    groups: int
    length: int
    rank: int  # the width computed: the largest rank among the step's adapters


@dataclass
class CpuLoRAPlan:
    """How one step's adapter rows are laid out for CPU LoRA, shared by every linear of the step:
    light adapters (few rows each: decode) in ``batches``, heavy ones (a prefill chunk) one by one
    in ``loop``. One batch at the step's largest rank: batches per rank class (8 / 16 / 32 / 64)
    measured slower (0.72 of base instead of 0.84 for 16 adapters): slots of one class are
    scattered, so each class gathered copies of its A and B, and paid 4x the calls."""

    loop: list[tuple[int, int, int]]  # (slot, start, end) run one by one
    batches: list[CpuLoRABatch] = field(default_factory=list)
    # With the C++ op (``meta.native``): the light adapters as flat (slot, start, end) triples, run
    # by one ``lora_segments`` call per linear at each slot's true rank (no grid, no padding).
    native_segs: list[int] = field(default_factory=list)


# Batched CPU LoRA pays for padding: every group computes L rows, and a view reads the buffers of
# idle slots. Adapters are batched while the grid stays within MAX_ROW_PADDING times their rows; a
# batch uses a view of its slot range unless it holds MAX_IDLE_SLOTS times as many slots as groups.
MAX_ROW_PADDING = 2.0
MAX_IDLE_SLOTS = 2.0
# The C++ op computes row by row (dot products, no GEMM blocking): adapters with more rows in the
# step than this (prefill chunks) keep the loop's matmuls.
NATIVE_MAX_ROWS = 16


def cpu_lora_plan(meta: LoRAMetadata, slot_ranks: list[int] | None = None) -> CpuLoRAPlan:
    """The layout for a linear whose slots have ``slot_ranks`` (None: every slot at the step's
    largest rank), built by the first linear with those ranks and cached on ``meta``: a step has
    a few distinct signatures (q/k/v, o, gate/up, down), each linear batching only the adapters
    that target it, at their largest rank in it."""
    key = None if slot_ranks is None else tuple(slot_ranks[s] for s, _, _ in meta.ranges)
    plans = meta.derived.setdefault("cpu_plans", {})
    if key not in plans:
        plans[key] = build_cpu_lora_plan(meta, slot_ranks=slot_ranks)
    return plans[key]


def build_cpu_lora_plan(
    meta: LoRAMetadata,
    max_padding: float = MAX_ROW_PADDING,
    use_view: bool | None = None,
    batch_all: bool = False,
    slot_ranks: list[int] | None = None,
) -> CpuLoRAPlan:
    """Split ``meta.ranges`` (those of slots with a rank in this linear, ``slot_ranks``) into batched
    (shortest first, while ``G * L <= max_padding * rows + 8``) and looped adapters. ``use_view``:
    force the slot-range view (True) or gathered slots (False); ``batch_all``: batch every adapter
    whatever the padding (tests)."""
    ranges = [r for r in meta.ranges if r[2] > r[1] and (slot_ranks is None or slot_ranks[r[0]] > 0)]
    if meta.native:
        light = [r for r in ranges if r[2] - r[1] <= NATIVE_MAX_ROWS]
        return CpuLoRAPlan(
            loop=[r for r in ranges if r[2] - r[1] > NATIVE_MAX_ROWS],
            native_segs=[v for r in light for v in r],
        )
    by_len = sorted(ranges, key=lambda r: r[2] - r[1])
    k, rows = 0, 0
    for i, (_, s, e) in enumerate(by_len):
        rows += e - s
        if batch_all or (i + 1) * (e - s) <= max_padding * rows + 8:
            k = i + 1
    batched = sorted(by_len[:k])  # by slot
    if len(batched) < 2:  # one adapter: the loop's plain matmuls
        return CpuLoRAPlan(loop=ranges)
    loop = [r for r in ranges if r not in batched]
    rank = meta.max_rank if slot_ranks is None else max(slot_ranks[r[0]] for r in batched)
    return CpuLoRAPlan(loop=loop, batches=[_batch(batched, rank, use_view)])


def _batch(members: list[tuple[int, int, int]], rank: int, use_view: bool | None) -> CpuLoRABatch:
    length = max(e - s for _, s, e in members)
    lo, hi = members[0][0], members[-1][0]
    if use_view is None:
        use_view = hi - lo + 1 <= MAX_IDLE_SLOTS * len(members)
    groups = hi - lo + 1 if use_view else len(members)
    index = [members[0][1]] * (groups * length)
    valid: list[int] = []
    dest: list[int] = []
    for g, (slot, s, e) in enumerate(members):
        base = (slot - lo if use_view else g) * length
        index[base : base + length] = [*range(s, e), *([s] * (length - (e - s)))]
        valid.extend(range(base, base + e - s))
        dest.extend(range(s, e))
    contiguous = dest == list(range(dest[0], dest[0] + len(dest)))
    return CpuLoRABatch(
        x_index=torch.tensor(index, dtype=torch.int64),
        valid=torch.tensor(valid, dtype=torch.int64),
        rows=None if contiguous else torch.tensor(dest, dtype=torch.int64),
        row_start=dest[0] if contiguous else None,
        slots=None if use_view else torch.tensor([m[0] for m in members], dtype=torch.int64),
        slot_lo=lo,
        groups=groups,
        length=length,
        rank=rank,
    )


def _live_slices(
    lora_a_slices: list[torch.Tensor | None], lora_b_slices: list[torch.Tensor | None], offsets: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """``(A, B, offset)`` of the slices some adapter targets (buffers allocated)."""
    return [
        (a, b, off)
        for a, b, off in zip(lora_a_slices, lora_b_slices, offsets)
        if a is not None and b is not None
    ]


def add_lora_cpu(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_slices: list[torch.Tensor | None],
    lora_b_slices: list[torch.Tensor | None],
    meta: LoRAMetadata,
    offsets: list[int],
    slot_ranks: list[int],
    slot_shared_a: list[bool] | None = None,
    *,
    plan: CpuLoRAPlan | None = None,
) -> None:
    """CPU path over a fused linear. Light adapters (decode rows): with ``meta.native`` one C++
    SGMV call (``kernels/cpu_native.lora_segments``) at each slot's true rank; otherwise their rows
    gathered into a ``[G, L, in]`` grid, per slice one ``bmm`` shrink and one ``bmm`` expand at the
    largest rank among them and one add into ``y``. Heavy ones (prefill chunks) one by one over
    their contiguous rows, a matmul pair per slice (one shrink for all slices when they share one
    A). Measured on SmolLM2, 16 adapters of ranks 8-64 on q/k/v/o among 32 requests, tokens/s kept
    of base: the loop alone 0.72 (~100 small matmuls per layer and step), the bmm grid 0.71-0.84,
    the C++ op 0.84-0.90 (benchmarks/lora.py --targets qkvo).

    Semantics: ``for slot, s, e in meta.ranges: for i: y[s:e, off_i:off_i+N_i] += (x[s:e] @ A_i[slot, :r].T) @ Bt_i[slot, :r]`` (``Bt_i = B_i.T`` per slot)

    Args:
        y: ``[T, Ntot]`` base output, updated in place.
        x: ``[T, H]`` layer input.
        lora_a_slices: per slice ``[S, R, H]`` or ``None``; rows past a slot's rank are zero.
        lora_b_slices: per slice B transposed, ``[S, R, N_i]`` (scaling folded in), or ``None``.
        meta: ``meta.ranges``, the contiguous rows of each slot.
        offsets: first column of each slice in ``y``.
        slot_ranks: each slot's rank in this linear (0: the slot does not target it).
        slot_shared_a: per slot, whether all its slices hold the same A (fused-module LoRA).
        plan: the layout (default: ``cpu_lora_plan(meta, slot_ranks)``, shared by the step's
            linears with the same slot ranks).
    """
    if x.shape[0] == 0 or not meta.ranges:
        return
    live = _live_slices(lora_a_slices, lora_b_slices, offsets)
    if not live:
        return
    plan = plan or cpu_lora_plan(meta, slot_ranks)
    if plan.native_segs:
        shared = slot_shared_a if slot_shared_a is not None else [False] * len(slot_ranks)
        lora_segments(
            x, y, [a for a, _, _ in live], [b for _, b, _ in live], [off for _, _, off in live],
            plan.native_segs, slot_ranks, shared,
        )  # fmt: skip
    for bt in plan.batches:
        g, n, r = bt.groups, bt.length, bt.rank
        shared = slot_shared_a is not None and all(
            slot_shared_a[slot] or slot_ranks[slot] == 0 for slot, _, _ in meta.ranges
        )
        xg = x.index_select(0, bt.x_index).view(g, n, x.shape[1])  # [G, L, H]
        t = None
        for a, b, off in live:
            a_r, b_r = a[:, :r], b[:, :r]  # [S, r, H], [S, r, N_i] views
            if bt.slots is None:
                a_r, b_r = a_r[bt.slot_lo : bt.slot_lo + g], b_r[bt.slot_lo : bt.slot_lo + g]
            else:
                a_r, b_r = a_r.index_select(0, bt.slots), b_r.index_select(0, bt.slots)
            if t is None or not shared:
                t = torch.bmm(xg, a_r.transpose(1, 2))  # [G, L, r]
            out = torch.bmm(t, b_r).view(g * n, -1).index_select(0, bt.valid)  # [n, N_i]
            cols = y[:, off : off + b.shape[2]]
            if bt.row_start is not None:
                cols[bt.row_start : bt.row_start + out.shape[0]].add_(out)
            else:
                cols.index_add_(0, bt.rows, out)  # type: ignore[arg-type]
    for slot, s, e in plan.loop:
        r = slot_ranks[slot]
        if r == 0:
            continue
        xs = x[s:e]
        t = None
        for a, b, off in live:
            if t is None or not (slot_shared_a is not None and slot_shared_a[slot]):
                t = xs @ a[slot, :r].t()  # [n, r]
            y[s:e, off : off + b.shape[2]].addmm_(t, b[slot, :r])
