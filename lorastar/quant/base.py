"""Quantization interface, vLLM's split.

``QuantConfig.from_config`` reads a checkpoint's ``quantization_config``; ``get_linear_method``
gives each linear layer a ``QuantMethod`` that creates its parameters (``create_weights``),
loads checkpoint tensors into them (``load_weight``), repacks them once loaded
(``process_weights_after_loading``) and runs the matmul (``apply``).

Parameter metadata (attributes set on each ``nn.Parameter``) tells the generic loader where a
checkpoint shard goes in a fused layer (q/k/v -> qkv_proj, gate/up -> gate_up_proj):
  ``output_dim``  the dimension that indexes output features (``None``: one entry per shard,
                  e.g. a per-tensor scale stored as ``[num_shards]``)
  ``output_pack`` how many output features one stored element holds along ``output_dim``
                  (8 for AWQ's int32-packed ``qweight``/``qzeros``; 1 otherwise)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from lorastar.models.linear import Linear


def set_param_meta(
    param: nn.Parameter, *, output_dim: int | None, output_pack: int = 1, **extra: Any
) -> None:
    param.output_dim = output_dim  # type: ignore[attr-defined]
    param.output_pack = output_pack  # type: ignore[attr-defined]
    for k, v in extra.items():
        setattr(param, k, v)


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
        target = param.data
        if shard is not None:
            out_dim = getattr(param, "output_dim", None)
            if out_dim is None:
                target = target[shard]
            else:
                pack = getattr(param, "output_pack", 1)
                offset = sum(layer.output_sizes[:shard]) // pack
                size = layer.output_sizes[shard] // pack
                target = target.narrow(out_dim, offset, size)
        if tuple(target.shape) != tuple(loaded.shape):
            raise ValueError(
                f"{source}: shape {tuple(loaded.shape)} does not match expected {tuple(target.shape)}"
            )
        if (
            target.dtype in (torch.int32, torch.int8, torch.uint8, torch.int64)
            or loaded.dtype == target.dtype
        ):
            target.copy_(loaded)
        elif target.dtype.is_floating_point and target.element_size() == 1:
            target.copy_(loaded.to(target.dtype))
        else:
            target.copy_(loaded.to(target.dtype))
        param.loaded_shards = getattr(param, "loaded_shards", set()) | {shard}  # type: ignore[attr-defined]

    def process_weights_after_loading(self, layer: Linear) -> None:  # noqa: B027 - optional hook
        """Repack or convert weights once every shard is loaded."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [tokens, input_size] -> [tokens, sum(output_sizes)]``."""

    def expected_tensors(self) -> tuple[str, ...]:
        """Checkpoint suffixes this method reads for each linear (``weight``, ``qweight``, ...)."""
        return ("weight",)


class UnquantizedLinearMethod(QuantMethod):
    """Plain dense weight ``[out, in]``."""

    def create_weights(
        self, layer: Linear, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        w = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False)
        set_param_meta(w, output_dim=0)
        layer.register_parameter("weight", w)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        return layer.weight.data


class QuantConfig(ABC):
    """A checkpoint's quantization scheme; one instance per model."""

    name: str = ""

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantConfig:
        """Build from the ``quantization_config`` dict of ``config.json``."""

    @abstractmethod
    def get_linear_method(self, prefix: str) -> QuantMethod:
        """The method for the linear layer at ``prefix`` (e.g. ``model.layers.0.self_attn.qkv_proj``)."""

    def get_kv_cache_scales(self) -> dict[str, float] | None:
        """Per-layer KV scales declared by the checkpoint, if any."""
        return None
