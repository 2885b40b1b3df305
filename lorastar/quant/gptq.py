"""GPTQ (auto-gptq / gptqmodel format): 4- or 8-bit weights, sym or asym, act-order (``g_idx``).

Checkpoint tensors per linear (``p = 32 / bits`` values per int32 word, ``G`` groups):
  ``qweight`` ``[in/p, out]`` int32   input rows packed sequentially into each word
  ``qzeros``  ``[G, out/p]`` int32    output columns packed sequentially
  ``scales``  ``[G, out]`` fp16
  ``g_idx``   ``[in]`` int32          group of each input row (a permutation's groups with desc_act)
``W[k, n] = (q[k, n] - (z[g_idx[k], n] + off)) * s[g_idx[k], n]``, ``off = 1`` for the original
format (``checkpoint_format: gptq``, zeros stored minus one) and 0 for ``gptq_v2``.
Linears left unquantized (``modules_in_block_to_quantize``, ``modules_to_not_convert``, gptqmodel's
``dynamic`` ``-:`` patterns) load as plain weights; ``dynamic`` settings override bits / group / sym /
act-order per module.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from lorastar.layers.linear import Linear, QuantMethod, UnquantizedLinearMethod, mark_loaded, set_param_meta
from lorastar.quant.base import QuantConfig
from lorastar.quant.utils import (
    adopt_scales_dtype,
    fused_lookup,
    is_skipped,
    matmul_dequant_chunked,
    regex_names,
    served_names,
)

_ZERO_OFFSET = {"gptq": 1, "gptq_v1": 1, "gptq_v2": 0}
# Settings a ``dynamic`` entry may override per module (gptqmodel also writes tuning-only keys).
_DYNAMIC_KEYS = {
    "bits", "group_size", "desc_act", "sym",
    "damp_percent", "damp_auto_increment", "mse", "static_groups", "true_sequential", "act_group_aware",
}  # fmt: skip


def unpack_gptq_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``[K/p, N]`` -> ``[K, N]`` int32."""
    per = 32 // bits
    shifts = (torch.arange(per, dtype=torch.int32, device=packed.device) * bits).view(1, per, 1)
    return ((packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1, packed.shape[1])


def unpack_gptq_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``[G, N/p]`` -> ``[G, N]`` int32."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(packed.shape[0], -1)


class GPTQConfig(QuantConfig):
    name = "gptq"

    def __init__(
        self,
        bits: int,
        group_size: int,
        desc_act: bool,
        sym: bool,
        zero_offset: int,
        skip: list[str],
        in_block: list[str] | None = None,
    ) -> None:
        self.bits = bits
        self.group_size = group_size  # -1: one group over the whole input
        self.desc_act = desc_act
        self.sym = sym
        self.zero_offset = zero_offset
        self.skip = skip
        # modules_in_block_to_quantize, flattened (None: every linear of a block is quantized).
        self.in_block = in_block
        # gptqmodel's per-module ``dynamic`` overrides (pattern -> settings) and the settings they
        # override (the checkpoint's own quantization_config without them).
        self.dynamic: dict[str, dict[str, Any]] = {}
        self.base_config: dict[str, Any] = {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        bits = int(config.get("bits", 4))
        if bits not in (4, 8):
            raise ValueError(
                f"GPTQ: only 4- and 8-bit weights are supported, quantization_config has bits={bits}"
            )
        group_size = int(config.get("group_size", 128))
        if group_size != -1 and (group_size <= 0 or group_size % (32 // bits)):
            raise ValueError(
                f"GPTQ: group_size must be -1 or a positive multiple of {32 // bits}, got {group_size}"
            )
        fmt = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
        if config.get("is_marlin_format"):  # auto-gptq <= 0.7's flag for its Marlin repacking
            fmt = "marlin"
        if fmt not in _ZERO_OFFSET:
            raise ValueError(
                f"GPTQ: checkpoint_format {fmt!r} is not supported (expected 'gptq' or 'gptq_v2')"
            )
        if config.get("lm_head"):
            raise ValueError("GPTQ: quantized lm_head (lm_head=true) is not supported")
        dynamic = config.get("dynamic") or {}
        if not isinstance(dynamic, dict) or not all(isinstance(v, dict) for v in dynamic.values()):
            raise ValueError(f"GPTQ: dynamic must map module patterns to settings, got {dynamic!r}")
        for pattern, overrides in dynamic.items():
            unknown = set(overrides) - _DYNAMIC_KEYS
            if unknown and not pattern.startswith("-:"):
                raise ValueError(
                    f"GPTQ: dynamic[{pattern!r}] overrides {sorted(unknown)}; only {sorted(_DYNAMIC_KEYS)} "
                    "are supported per module"
                )
        pack_dtype = str(config.get("pack_dtype", "int32"))
        if pack_dtype not in ("int32", "torch.int32"):
            raise ValueError(f"GPTQ: pack_dtype {pack_dtype!r} is not supported (expected int32)")
        skip = list(config.get("modules_to_not_convert") or [])
        out = cls(
            bits,
            group_size,
            bool(config.get("desc_act", False)),
            bool(config.get("sym", True)),
            _ZERO_OFFSET[fmt],
            skip,
            _flatten_in_block(config.get("modules_in_block_to_quantize")),
        )
        out.base_config = {k: v for k, v in config.items() if k != "dynamic"}
        out.dynamic = dict(dynamic)
        for pattern, overrides in dynamic.items():  # each override must itself be a supported scheme
            if not pattern.startswith("-:") and overrides:
                out._with(overrides)
        return out

    def _with(self, overrides: dict[str, Any]) -> GPTQConfig:
        try:
            return GPTQConfig.from_config({**self.base_config, **overrides})
        except ValueError as e:
            raise ValueError(f"GPTQ: dynamic override {overrides}: {e}") from None

    def _dynamic_for(self, name: str) -> dict[str, Any] | bool | None:
        """gptqmodel's ``dynamic_get``: the first pattern that ``re.match``-es the module name; a
        ``-:`` pattern leaves it unquantized (False), others give its settings (None: no match).
        Served or checkpoint names of the module (``regex_names``: vLLM's keep the prefix)."""
        names = regex_names(name, self.key_map)
        for pattern, overrides in self.dynamic.items():
            if pattern.startswith("-:"):
                if any(re.match(pattern[2:], n) for n in names):
                    return False
            elif any(re.match(pattern.removeprefix("+:"), n) for n in names):
                return overrides
        return None

    def _dynamic_method(self, prefix: str) -> QuantMethod | None:
        """The layer's method under ``dynamic`` (None: the checkpoint's default settings)."""
        found = fused_lookup(
            prefix,
            self.packed_modules_mapping,
            self._dynamic_for,
            "GPTQ dynamic gives {parts} different settings",
        )
        if found is False:
            return UnquantizedLinearMethod()
        if found:
            return GPTQLinearMethod(self._with(found))
        return None

    def _outside_in_block(self, prefix: str) -> bool:
        """Whether ``modules_in_block_to_quantize`` leaves the layer unquantized. optimum (which
        transformers loads GPTQ with) keeps a block's linear when its name ends with a listed one."""
        if self.in_block is None:
            return False
        in_block = served_names(self.in_block, self.key_map)  # the checkpoint's names

        def listed(name: str) -> bool | None:
            return True if any(name.endswith(m) for m in in_block) else None

        mixed = "modules_in_block_to_quantize quantizes only some of {parts}"
        return fused_lookup(prefix, self.packed_modules_mapping, listed, mixed) is None

    def get_linear_method(self, prefix: str) -> QuantMethod:
        skip = served_names(self.skip, self.key_map)
        if is_skipped(prefix, skip, self.packed_modules_mapping, self.key_map) or self._outside_in_block(
            prefix
        ):
            return UnquantizedLinearMethod()
        if self.dynamic and (method := self._dynamic_method(prefix)) is not None:
            return method
        return GPTQLinearMethod(self)

    def __repr__(self) -> str:
        return (
            f"GPTQConfig(bits={self.bits}, group_size={self.group_size}, desc_act={self.desc_act}, "
            f"sym={self.sym}, zero_offset={self.zero_offset})"
        )


def _flatten_in_block(value: Any) -> list[str] | None:
    """``modules_in_block_to_quantize``: a list of lists of names (one per sequential step, as
    optimum writes it) or a flat list."""
    if not value:
        return None
    if not isinstance(value, list):
        raise ValueError(f"GPTQ: modules_in_block_to_quantize must be a list, got {value!r}")
    out: list[str] = []
    for item in value:
        out.extend(item if isinstance(item, list) else [item])
    if not all(isinstance(m, str) and m for m in out):
        raise ValueError(f"GPTQ: modules_in_block_to_quantize must list module names, got {value!r}")
    return out


class GPTQLinearMethod(QuantMethod):
    def __init__(self, config: GPTQConfig) -> None:
        self.config = config
        self.group_size = 0  # resolved per layer (-1 -> input size)
        self.trivial_gidx = True  # g_idx == k // group_size: the kernel computes groups itself

    def create_weights(
        self, layer: Linear, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        bits = self.config.bits
        per = 32 // bits
        g = input_size if self.config.group_size == -1 else self.config.group_size
        self.group_size = g
        if input_size % per:
            raise ValueError(
                f"GPTQ: {layer.prefix}: input size {input_size} is not a multiple of {per} (packing)"
            )
        for s in output_sizes:
            if s % per:
                raise ValueError(
                    f"GPTQ: {layer.prefix}: output size {s} is not a multiple of {per} (packing)"
                )
        groups = -(-input_size // g)
        out = sum(output_sizes)
        qweight = nn.Parameter(torch.zeros(input_size // per, out, dtype=torch.int32), requires_grad=False)
        set_param_meta(qweight, output_dim=1)
        qzeros = nn.Parameter(torch.zeros(groups, out // per, dtype=torch.int32), requires_grad=False)
        set_param_meta(qzeros, output_dim=1, output_pack=per)
        # fp16 like the file; load_weight adopts the checkpoint's dtype if it differs.
        scales = nn.Parameter(torch.zeros(groups, out, dtype=torch.float16), requires_grad=False)
        set_param_meta(scales, output_dim=1)
        # One g_idx for the fused layer: q/k/v (gate/up) see the same input, so act-order gives them
        # the same permutation; load_weight checks that. Without act-order it defaults to the
        # identity grouping (some writers omit it; gptqmodel and vLLM start from the same default)
        # and only act-order checkpoints must store it (the loader checks tensors with output_dim).
        g_idx = nn.Parameter(torch.arange(input_size, dtype=torch.int32) // g, requires_grad=False)
        if self.config.desc_act:
            set_param_meta(g_idx, output_dim=None)
        for name, p in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales), ("g_idx", g_idx)):
            layer.register_parameter(name, p)

    def load_weight(
        self, layer: Linear, name: str, loaded: torch.Tensor, shard: int | None, source: str
    ) -> None:
        if name in ("qweight", "qzeros") and loaded.dtype != torch.int32:
            raise ValueError(f"{source}: GPTQ {name} must be int32, got {loaded.dtype}")
        if name == "scales":
            adopt_scales_dtype(layer.scales, loaded)
        if name != "g_idx":
            super().load_weight(layer, name, loaded, shard, source)
            return
        param = layer.g_idx
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(
                f"{source}: shape {tuple(loaded.shape)} does not match expected {tuple(param.shape)}"
            )
        seen = getattr(param, "loaded_shards", set())
        if seen and not torch.equal(param.data, loaded.to(torch.int32)):
            raise ValueError(
                f"{source}: g_idx differs from the other shards of {layer.prefix} (cannot fuse act-order shards)"
            )
        param.data.copy_(loaded.to(torch.int32))
        mark_loaded(param, shard)

    def expected_tensors(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales", "g_idx")

    def process_weights_after_loading(self, layer: Linear) -> None:
        k = layer.input_size
        g_idx = layer.g_idx.data
        groups = layer.scales.shape[0]
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"{layer.prefix}.g_idx: group indices outside 0..{groups - 1}")
        default = torch.arange(k, device=g_idx.device, dtype=torch.int32) // self.group_size
        self.trivial_gidx = bool(torch.equal(g_idx, default))

    def _dequant_cols(self, layer: Linear, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """``W[:, lo:hi]`` as ``[in, hi - lo]`` in ``dtype``."""
        bits, per = self.config.bits, 32 // self.config.bits
        q = unpack_gptq_rows(layer.qweight[:, lo:hi], bits)  # [K, n]
        z = unpack_gptq_cols(layer.qzeros[:, lo // per : hi // per], bits) + self.config.zero_offset  # [G, n]
        s = layer.scales[:, lo:hi]  # [G, n]
        k = q.shape[0]
        # Product in the scales' dtype (as gptqmodel dequantizes), then the compute dtype.
        if self.trivial_gidx and k % self.group_size == 0:
            g = self.group_size
            w = (q.view(k // g, g, -1) - z.unsqueeze(1)).to(s.dtype) * s.unsqueeze(1)
            return w.view(k, -1).to(dtype)
        gi = layer.g_idx.long()
        return ((q - z[gi]).to(s.dtype) * s[gi]).to(dtype)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.is_cuda:
            from lorastar.kernels.quant_gemm import gptq_gemm

            y = gptq_gemm(
                x2.contiguous(),
                layer.qweight,
                layer.qzeros,
                layer.scales,
                None if self.trivial_gidx else layer.g_idx,
                self.config.bits,
                self.group_size,
                self.config.zero_offset,
            )
        else:
            per = 32 // self.config.bits
            y = matmul_dequant_chunked(
                x2, layer.output_size, per, lambda lo, hi: self._dequant_cols(layer, lo, hi, x2.dtype)
            )
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*lead, y.shape[-1])

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        """``[out, in]`` fp32."""
        return self._dequant_cols(layer, 0, layer.output_size, torch.float32).t().contiguous()
