"""AWQ (AutoAWQ GEMM format): 4-bit weights, zero points, group-wise scales.

Checkpoint tensors per linear (``in`` = input features, ``out`` = output features, ``g`` = group):
  ``qweight`` ``[in, out/8]`` int32   eight 4-bit columns per word, AWQ order [0, 2, 4, 6, 1, 3, 5, 7]
  ``qzeros``  ``[in/g, out/8]`` int32 same packing
  ``scales``  ``[in/g, out]`` fp16
``W[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]``. Only the packed form is kept in memory: CPU
dequantizes a chunk of columns per call, CUDA runs the fused Triton GEMM.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lorastar.layers.linear import Linear, QuantMethod, UnquantizedLinearMethod, set_param_meta
from lorastar.quant.base import QuantConfig
from lorastar.quant.utils import adopt_scales_dtype, is_skipped, matmul_dequant_chunked, served_names

# Column j of a packed word sits in nibble AWQ_REVERSE_ORDER[j] (AutoAWQ's interleaved order).
_AWQ_SHIFTS = torch.tensor([0, 16, 4, 20, 8, 24, 12, 28], dtype=torch.int32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` int32 -> ``[R, 8C]`` int32 in ``0..15`` (vectorised; the oracle is in reference.py)."""
    shifts = _AWQ_SHIFTS.to(packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)


class AWQConfig(QuantConfig):
    name = "awq"

    def __init__(self, bits: int, group_size: int, zero_point: bool, skip: list[str]) -> None:
        self.bits = bits
        self.group_size = group_size
        self.zero_point = zero_point
        self.skip = skip

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        bits = int(config.get("bits", config.get("w_bit", 4)))
        if bits != 4:
            raise ValueError(f"AWQ: only 4-bit weights are supported, quantization_config has bits={bits}")
        group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        if group_size <= 0 or group_size % 8:
            raise ValueError(f"AWQ: group_size must be a positive multiple of 8, got {group_size}")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"AWQ: only the GEMM packing is supported, quantization_config has version={version!r}"
            )
        zero_point = bool(config.get("zero_point", True))
        if not zero_point:
            raise ValueError("AWQ: zero_point=false checkpoints are not supported")
        skip = list(config.get("modules_to_not_convert") or [])
        return cls(bits, group_size, zero_point, skip)

    def get_linear_method(self, prefix: str) -> QuantMethod:
        if is_skipped(
            prefix, served_names(self.skip, self.key_map), self.packed_modules_mapping, self.key_map
        ):
            return UnquantizedLinearMethod()
        return AWQLinearMethod(self)

    def __repr__(self) -> str:
        return f"AWQConfig(bits={self.bits}, group_size={self.group_size})"


class AWQLinearMethod(QuantMethod):
    def __init__(self, config: AWQConfig) -> None:
        self.config = config

    def create_weights(
        self, layer: Linear, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        g = self.config.group_size
        if input_size % g:
            raise ValueError(
                f"AWQ: {layer.prefix}: input size {input_size} is not a multiple of group_size {g}"
            )
        for s in output_sizes:
            if s % 8:
                raise ValueError(f"AWQ: {layer.prefix}: output size {s} is not a multiple of 8 (packing)")
        out = sum(output_sizes)
        qweight = nn.Parameter(torch.zeros(input_size, out // 8, dtype=torch.int32), requires_grad=False)
        set_param_meta(qweight, output_dim=1, output_pack=8)
        qzeros = nn.Parameter(torch.zeros(input_size // g, out // 8, dtype=torch.int32), requires_grad=False)
        set_param_meta(qzeros, output_dim=1, output_pack=8)
        # fp16 like the file; load_weight adopts the checkpoint's dtype if it differs.
        scales = nn.Parameter(torch.zeros(input_size // g, out, dtype=torch.float16), requires_grad=False)
        set_param_meta(scales, output_dim=1)
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("qzeros", qzeros)
        layer.register_parameter("scales", scales)

    def load_weight(
        self, layer: Linear, name: str, loaded: torch.Tensor, shard: int | None, source: str
    ) -> None:
        if name in ("qweight", "qzeros") and loaded.dtype != torch.int32:
            raise ValueError(f"{source}: AWQ {name} must be int32, got {loaded.dtype}")
        if name == "scales":
            adopt_scales_dtype(layer.scales, loaded)
        super().load_weight(layer, name, loaded, shard, source)

    def expected_tensors(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")

    def _dequant_cols(self, layer: Linear, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """``W[:, lo:hi]`` (``lo``/``hi`` multiples of 8) as ``[in, hi - lo]`` in ``dtype``."""
        g = self.config.group_size
        q = unpack_awq(layer.qweight[:, lo // 8 : hi // 8])  # [K, n]
        z = unpack_awq(layer.qzeros[:, lo // 8 : hi // 8])  # [K/g, n]
        s = layer.scales[:, lo:hi]  # [K/g, n]
        k = q.shape[0]
        # Product in the scales' dtype (as AutoAWQ / gptqmodel dequantize), then the compute dtype.
        w = (q.view(k // g, g, -1) - z.unsqueeze(1)).to(s.dtype) * s.unsqueeze(1)  # [K/g, g, n]
        return w.view(k, -1).to(dtype)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.is_cuda:
            from lorastar.kernels.quant_gemm import awq_gemm

            y = awq_gemm(x2.contiguous(), layer.qweight, layer.qzeros, layer.scales, self.config.group_size)
        else:
            y = matmul_dequant_chunked(
                x2, layer.output_size, 8, lambda lo, hi: self._dequant_cols(layer, lo, hi, x2.dtype)
            )
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*lead, y.shape[-1])

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        """``[out, in]`` fp32 (for tests and the LoRA-on-quant reference)."""
        return self._dequant_cols(layer, 0, layer.output_size, torch.float32).t().contiguous()
