"""``quantization="int8"``: a 16/32-bit checkpoint's linears quantized at load to per-channel int8,
activations quantized per token at run time (W8A8, SmoothQuant's dynamic scheme without smoothing).

The CPU path (``kernels/int8.py``: ``torch._int_mm``, int32 accumulation): 1.4-1.7x oneDNN fp32
on SmolLM2's linears and a quarter of their weight bytes. The embedding and lm_head stay as they
are (``embedding_quantization="int8"`` quantizes those separately); LoRA deltas stay in float.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lorastar.kernels.int8 import INT8_MAX, int8_linear, quantize_weight_per_channel
from lorastar.layers.linear import Linear, QuantMethod, load_shard, set_param_meta
from lorastar.quant.base import QuantConfig


class Int8LinearMethod(QuantMethod):
    """One int8 linear. Loading quantizes each float shard by rows into ``weight [out, in]`` int8 and
    ``weight_scale [out]``; ``process_weights_after_loading`` keeps only the transposed copy
    ``weight_t [in, out]`` (the layout ``_int_mm`` runs fastest on from 4 rows up)."""

    act_qmax = INT8_MAX  # activations' per-token scale: amax / act_qmax (``quantize_per_token``)

    def create_weights(
        self, layer: Linear, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        out = sum(output_sizes)
        weight = nn.Parameter(torch.zeros(out, input_size, dtype=torch.int8), requires_grad=False)
        set_param_meta(weight, output_dim=0)
        layer.register_parameter("weight", weight)
        # Derived at load (no output_dim: not looked for in the checkpoint).
        layer.register_parameter(
            "weight_scale", nn.Parameter(torch.ones(out, dtype=torch.float32), requires_grad=False)
        )
        layer.register_buffer("weight_t", torch.empty(0, dtype=torch.int8), persistent=False)

    def load_weight(
        self, layer: Linear, name: str, loaded: torch.Tensor, shard: int | None, source: str
    ) -> None:
        if name != "weight":
            super().load_weight(layer, name, loaded, shard, source)
            return
        if not loaded.dtype.is_floating_point or loaded.element_size() == 1:
            raise ValueError(
                f"{source}: quantization='int8' needs a 16/32-bit float weight, got {loaded.dtype}"
            )
        if loaded.dim() != 2 or loaded.shape[1] != layer.input_size:
            raise ValueError(f"{source}: shape {tuple(loaded.shape)} does not match [*, {layer.input_size}]")
        q, scale = quantize_weight_per_channel(loaded.to(layer.weight.device))
        load_shard(layer.weight, layer.output_sizes, q, shard, source)
        load_shard(layer.weight_scale, layer.output_sizes, scale, shard, source, by_rows=True)

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.weight_t = layer.weight.data.t().contiguous()  # [in, out]
        layer.weight.data = torch.empty(0, dtype=torch.int8)  # the transposed copy replaces it

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        y = int8_linear(x.reshape(-1, x.shape[-1]), layer.weight_t, layer.weight_scale, bias, self.act_qmax)
        return y.reshape(*lead, y.shape[-1])

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        """``[out, in]`` fp32."""
        return layer.weight_t.t().float() * layer.weight_scale.view(-1, 1)


class Int8OnTheFlyConfig(QuantConfig):
    """``quantization="int8"`` on a 16/32-bit checkpoint (CPU): W8A8 with per-channel weight and
    per-token activation scales."""

    name = "int8"
    devices = ("cpu",)  # torch._int_mm's CPU path; on a GPU quantization="fp8" is the 8-bit scheme

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Int8OnTheFlyConfig:
        return cls()

    def get_linear_method(self, prefix: str) -> QuantMethod:
        return Int8LinearMethod()

    def __repr__(self) -> str:
        return "Int8OnTheFlyConfig()"
