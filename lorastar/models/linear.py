"""Linear layers that carry a quantization method and, optionally, LoRA slots."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from lorastar.quant.base import QuantMethod, UnquantizedLinearMethod, set_param_meta

if TYPE_CHECKING:
    from lorastar.adapters.layers import LoRASlots
    from lorastar.models.context import ForwardContext


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
        self.lora: LoRASlots | None = None

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)  # [tokens, output_size]
        if self.lora is not None and ctx is not None and ctx.lora is not None:
            self.lora.apply(x, y, ctx.lora)
        return y

    def slice_offsets(self) -> list[int]:
        offs = [0]
        for s in self.output_sizes:
            offs.append(offs[-1] + s)
        return offs

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, method={type(self.quant_method).__name__}"
