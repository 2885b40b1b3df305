"""Linear layers: the weight-storage method base classes (vLLM's ``LinearMethodBase`` split), the
one shard loader, and ``Linear`` itself. Quant formats subclass ``QuantMethod`` in ``quant/``.

A method creates the layer's parameters (``create_weights``), loads checkpoint tensors into them
(``load_weight``), repacks them once loaded (``process_weights_after_loading``) and runs the
matmul (``apply``). Parameter metadata (attributes set on each ``nn.Parameter``) tells the loader
where a checkpoint shard goes in a fused layer (q/k/v -> qkv_proj, gate/up -> gate_up_proj):
  ``output_dim``  the dimension that indexes output features (``None``: one entry per shard,
                  e.g. a per-tensor scale stored as ``[num_shards]``)
  ``output_pack`` how many output features one stored element holds along ``output_dim``
                  (8 for AWQ's int32-packed ``qweight``/``qzeros``; 1 otherwise)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lorastar.layers.cpu_gemm import pack, packable, packed_linear

if TYPE_CHECKING:
    from lorastar.forward_context import ForwardContext, LoRAMetadata


class LoRAHook(Protocol):
    """What ``Linear`` needs of its LoRA slots (``layers/lora.py`` implements it)."""

    def apply(self, x: torch.Tensor, y: torch.Tensor, meta: LoRAMetadata) -> None:
        """Add each row's adapter delta for ``x [T, in]`` into ``y [T, out]`` in place."""

    def fused_forward(self, x: torch.Tensor, meta: LoRAMetadata) -> torch.Tensor | None:
        """The whole output ``[T, out]`` (base and deltas) in one pass, or ``None``: base, then ``apply``."""


def set_param_meta(
    param: nn.Parameter, *, output_dim: int | None, output_pack: int = 1, **extra: Any
) -> None:
    param.output_dim = output_dim  # type: ignore[attr-defined]
    param.output_pack = output_pack  # type: ignore[attr-defined]
    for k, v in extra.items():
        setattr(param, k, v)


def mark_loaded(param: torch.Tensor, shard: int | None) -> None:
    """Record that ``shard`` of ``param`` was read (the loader reports the shards never read)."""
    param.loaded_shards = getattr(param, "loaded_shards", set()) | {shard}  # type: ignore[attr-defined]


def load_shard(
    param: torch.Tensor,
    output_sizes: list[int],
    loaded: torch.Tensor,
    shard: int | None,
    source: str,
    *,
    raw: bool = False,
    by_rows: bool = False,
) -> None:
    """Narrow ``param`` to ``shard`` (its ``output_dim`` / ``output_pack`` metadata; ``None``: the whole
    tensor), check the shape, copy ``loaded`` in (cast to the parameter's dtype) and mark the shard.
    ``raw``: copy bytes into a 1-byte parameter (``loaded`` is uint8; CPU lacks some fp8 copies).
    ``by_rows``: narrow along dim 0 whatever the metadata (derived parameters carry none)."""
    target = param.data.view(torch.uint8) if raw else param.data
    if shard is not None:
        out_dim = 0 if by_rows else getattr(param, "output_dim", None)
        if out_dim is None:
            target = target[shard]
        else:
            pack = getattr(param, "output_pack", 1)
            offset = sum(output_sizes[:shard]) // pack
            target = target.narrow(out_dim, offset, output_sizes[shard] // pack)
    if shard is None and getattr(param, "output_dim", 0) is None and loaded.numel() == 1 < target.numel():
        # One per-tensor value for a fused tensor (a fused checkpoint's scale): every shard has it.
        target.copy_(loaded.reshape(()).to(target.dtype).expand_as(target))
        mark_loaded(param, shard)
        return
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(
            f"{source}: shape {tuple(loaded.shape)} does not match expected {tuple(target.shape)}"
        )
    target.copy_(loaded.to(target.dtype))
    mark_loaded(param, shard)


class QuantMethod(ABC):
    """How one linear layer stores and multiplies its weight."""

    @abstractmethod
    def create_weights(
        self, layer: Linear, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        """Register the layer's parameters (empty, with metadata) on ``layer``."""

    def load_weight(
        self, layer: Linear, name: str, loaded: torch.Tensor, shard: int | None, source: str
    ) -> None:
        """Copy checkpoint tensor ``loaded`` (called ``source`` in the checkpoint) into parameter ``name``.

        ``shard`` is the index in ``layer.output_sizes`` for fused layers, ``None`` for whole tensors.
        """
        param = getattr(layer, name, None)
        if not isinstance(param, torch.Tensor):
            raise ValueError(f"{source}: unexpected tensor {name!r} for layer {layer.prefix!r}")
        load_shard(param, layer.output_sizes, loaded, shard, source)

    def process_weights_after_loading(self, layer: Linear) -> None:  # noqa: B027 - optional hook
        """Repack or convert weights once every shard is loaded."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [tokens, input_size] -> [tokens, sum(output_sizes)]``."""

    def expected_tensors(self) -> tuple[str, ...]:
        """Checkpoint suffixes this method reads for each linear (``weight``, ``qweight``, ...)."""
        return ("weight",)


class UnquantizedLinearMethod(QuantMethod):
    """Plain dense weight ``[out, in]``; on CPU optionally prepacked for oneDNN (``pack_for_cpu``),
    which then replaces the dense copy (``dequantized_weight`` unpacks on demand)."""

    def create_weights(
        self, layer: Linear, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        w = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False)
        set_param_meta(w, output_dim=0)
        layer.register_parameter("weight", w)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = layer.weight_packed
        if packed is not None:
            return packed_linear(x, packed, bias)
        return F.linear(x, layer.weight, bias)

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        if layer.weight_packed is not None:
            return layer.weight_packed.to_dense()
        return layer.weight.data

    def pack_for_cpu(self, layer: Linear) -> bool:
        """Reorder the weight for oneDNN and drop the dense copy (CPU weights of a dtype oneDNN runs
        natively here: ``cpu_gemm.packable``)."""
        w = layer.weight
        if w.device.type != "cpu" or not packable(w.dtype):
            return False
        layer.weight_packed = pack(w.data)
        w.data = torch.empty(0, dtype=w.dtype)  # the packed copy replaces it
        return True


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` with ``W`` stored by ``quant_method``; fused layers list several
    ``output_sizes`` (q/k/v or gate/up), each a *slice* that LoRA adapters address by its
    ``slice_names`` entry (the PEFT target-module name, e.g. ``"q_proj"``)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool,
        prefix: str,
        slice_names: list[str],
        params_dtype: torch.dtype,
        quant_method: QuantMethod | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.prefix = prefix
        self.slice_names = list(slice_names)
        self.params_dtype = params_dtype
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, self.output_sizes, params_dtype)
        if bias:
            b = nn.Parameter(torch.zeros(self.output_size, dtype=params_dtype), requires_grad=False)
            set_param_meta(b, output_dim=0)
            self.bias = b
        else:
            self.bias = None
        self.lora: LoRAHook | None = None
        self.weight_packed: torch.Tensor | None = None  # oneDNN-packed weight (CPU backend), else None

    def weight_loader(self, name: str, loaded: torch.Tensor, shard: int | None, source: str) -> None:
        """Route checkpoint tensor ``source`` (suffix ``name``: ``weight``, ``qweight``, ``bias``, ...)
        for ``shard`` into this layer: the bias directly, everything else through the quant method."""
        if name != "bias":
            self.quant_method.load_weight(self, name, loaded, shard, source)
        elif self.bias is None:
            raise ValueError(f"unexpected bias tensor {source!r}: the config declares no bias here")
        else:
            load_shard(self.bias, self.output_sizes, loaded, shard, source)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        meta = ctx.lora if ctx is not None and self.lora is not None else None
        if meta is not None and (fused := self.lora.fused_forward(x, meta)) is not None:  # type: ignore[union-attr]
            return fused  # [tokens, output_size], rows may be strided (a view)
        y = self.quant_method.apply(self, x, self.bias)  # [tokens, output_size]
        if meta is not None:
            self.lora.apply(x, y, meta)  # type: ignore[union-attr]
        return y

    def slice_offsets(self) -> list[int]:
        offs = [0]
        for s in self.output_sizes:
            offs.append(offs[-1] + s)
        return offs

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, method={type(self.quant_method).__name__}"
