"""compressed-tensors int checkpoints: weight-only (llm-compressor's W4A16, W4A16_ASYM, W8A16:
``format: pack-quantized``), served through the GPTQ layout and compute path; and W8A8 (int8
weights per channel, int8 activations per token, dynamic and symmetric: ``format: int-quantized``,
``weight`` int8 ``[out, in]`` and ``weight_scale`` ``[out, 1]``), served on the CPU by the int8
W8A8 path (``quant/int8.py``) with compressed-tensors' own activation scale (amax / 127.5).

Checkpoint tensors per linear (``bits`` 4 or 8, ``p = 32 / bits`` values per int32 word, ``G`` groups):
  ``weight_packed``     ``[out, in/p]`` int32  input columns packed sequentially (element ``j`` of a
                                              word at bits ``[bits*j, bits*(j+1))``), stored unsigned:
                                              ``q + 2**(bits-1)`` for the signed value ``q``
  ``weight_scale``      ``[out, G]``           (``[out, 1]`` for strategy ``channel``)
  ``weight_zero_point`` ``[out/p, G]`` int32   asymmetric only: the signed zero point, packed the same
                                              way (unsigned) along the OUTPUT dim
  ``weight_shape``      ``[2]`` int            ``[out, in]``
  ``weight_g_idx``      ``[in]`` int           group of each input column (older checkpoints with
                                              ``actorder: group``; compressed-tensors 0.19 no longer
                                              writes it)
``W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]``, the product in the scales' dtype (compressed-tensors'
``dequantize``). The stored unsigned values share the offset, so ``q_u - z_u`` is the same difference:
transposed, these are exactly GPTQ v2 tensors (``qweight = weight_packed.T``, ``qzeros =
weight_zero_point.T``, ``scales = weight_scale.T``, no zero offset); a symmetric layer gets the
constant zero point ``2**(bits-1)``. No new kernel: ``GPTQLinearMethod`` computes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lorastar.kernels.int8 import CT_INT8_HALF_RANGE
from lorastar.layers.linear import Linear, QuantMethod, UnquantizedLinearMethod, load_shard
from lorastar.quant.base import QuantConfig
from lorastar.quant.gptq import GPTQConfig, GPTQLinearMethod
from lorastar.quant.int8 import Int8LinearMethod
from lorastar.quant.utils import is_skipped, served_name, served_names, target_fused_lookup, target_lookup

# actorder values that store ``weight_g_idx`` ("dynamic" is compressed-tensors' alias of "group");
# "weight" / "static" only change the calibration order, not the format.
_GIDX_ORDERS = ("group", "dynamic")
_NO_GIDX_ORDERS = (None, False, "weight", "static")


@dataclass(frozen=True)
class IntWeightScheme:
    """One config group's weight scheme. ``group_size == -1``: one scale per output channel."""

    bits: int
    group_size: int
    symmetric: bool
    g_idx: bool  # actorder "group": weight_g_idx is stored and required
    act_per_token: bool = False  # W8A8: activations int8 per token, dynamic (format int-quantized)


def is_int_weight_config(config: dict[str, Any]) -> bool:
    """Whether a compressed-tensors ``quantization_config`` quantizes weights to ints (any group):
    such checkpoints go to ``CompressedTensorsWNA16Config``, float (FP8) ones elsewhere."""
    groups = config.get("config_groups") or {}
    return isinstance(groups, dict) and any(
        isinstance(g, dict) and isinstance(g.get("weights"), dict) and g["weights"].get("type") == "int"
        for g in groups.values()
    )


def _w8a8(w: dict[str, Any], act: Any) -> bool:
    """Whether a group is the W8A8 scheme served here (vLLM's ``CompressedTensorsW8A8Int8`` with
    dynamic per-token activations): int8 symmetric weights per channel, int8 symmetric dynamic
    activations per token."""
    return (
        isinstance(act, dict)
        and act.get("type") == "int"
        and int(act.get("num_bits", 0)) == 8
        and act.get("strategy") == "token"
        and act.get("dynamic") is True
        and act.get("symmetric", True) is True
        and int(w.get("num_bits", 0)) == 8
        and w.get("strategy") == "channel"
        and w.get("symmetric", True) is True
    )


def _int_scheme(gname: str, group: dict[str, Any], top_format: str | None = None) -> IntWeightScheme:
    where = f"compressed-tensors (pack-quantized int) config_groups.{gname}"
    w = group.get("weights")
    if not isinstance(w, dict) or w.get("type") != "int":
        raise ValueError(
            f"{where}.weights: mixed int and float schemes are not supported (type={None if not isinstance(w, dict) else w.get('type')!r})"
        )
    if group.get("output_activations"):
        raise ValueError(f"{where}.output_activations: output activation quantization is not supported")
    act = group.get("input_activations")
    fmt = group.get("format") or (top_format if top_format != "mixed-precision" else None)
    if act:
        where = f"compressed-tensors (int-quantized W8A8) config_groups.{gname}"
        if not _w8a8(w, act):
            raise ValueError(
                f"{where}.input_activations: with activation quantization only W8A8 is supported (int8 "
                "weights per channel, int8 activations per token, dynamic and symmetric; W4A8 and "
                f"static activation scales are not), got weights {_brief(w)} and activations {_brief(act)}"
            )
        if fmt is not None and fmt != "int-quantized":
            raise ValueError(f"{where}.format {fmt!r} is not supported for W8A8 (only 'int-quantized')")
        return IntWeightScheme(8, -1, True, False, act_per_token=True)
    if fmt is not None and fmt != "pack-quantized":
        raise ValueError(
            f"{where}.format {fmt!r} is not supported for weight-only int weights (only 'pack-quantized')"
        )
    bits = int(w.get("num_bits", 0))
    if bits not in (4, 8):
        raise ValueError(f"{where}.weights.num_bits must be 4 or 8, got {w.get('num_bits')!r}")
    if w.get("dynamic"):
        raise ValueError(f"{where}.weights.dynamic: dynamic weight quantization is not supported")
    if w.get("block_structure"):
        raise ValueError(f"{where}.weights.block_structure: block-wise int weights are not supported")
    # compressed-tensors' default: group when a group size is given, else tensor.
    strategy = str(w.get("strategy") or ("group" if w.get("group_size") else "tensor"))
    if strategy == "channel":
        group_size = -1
    elif strategy == "group":
        group_size = int(w.get("group_size") or 0)
        if group_size <= 0:
            raise ValueError(f"{where}.weights.group_size must be positive, got {w.get('group_size')!r}")
    else:
        raise ValueError(f"{where}.weights.strategy {strategy!r} is not supported (group or channel)")
    order = w.get("actorder")
    order = "group" if order is True else order
    if order not in _GIDX_ORDERS + _NO_GIDX_ORDERS:
        raise ValueError(f"{where}.weights.actorder {order!r} is not supported")
    return IntWeightScheme(bits, group_size, bool(w.get("symmetric", True)), order in _GIDX_ORDERS)


def _brief(scheme: dict[str, Any]) -> str:
    keys = ("num_bits", "strategy", "dynamic", "symmetric")
    return "{" + ", ".join(f"{k}={scheme.get(k)!r}" for k in keys) + "}"


class CompressedTensorsWNA16Config(QuantConfig):
    """A compressed-tensors checkpoint with int4/int8 weight-only ``pack-quantized`` groups.

    ``quantization=`` may be ``None`` or ``"compressed-tensors"`` (vLLM's name; it accepts any
    compressed-tensors checkpoint, FP8 ones too). ``"gptq"`` is refused on purpose: the serving path
    is GPTQ's, but the checkpoint is not a GPTQ one, and ``"gptq"`` checks that it is.
    Linears listed in ``ignore`` or matched by no group's ``targets`` load unquantized."""

    name = "compressed-tensors"

    def __init__(
        self,
        groups: list[tuple[list[str], IntWeightScheme]],
        ignore: list[str],
        kv_cache_scheme: dict[str, Any] | None,
    ) -> None:
        self.groups = groups
        self.ignore = ignore
        self.kv_cache_scheme = kv_cache_scheme

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsWNA16Config:
        fmt = config.get("format")
        if fmt not in (None, "pack-quantized", "int-quantized", "mixed-precision"):
            raise ValueError(
                f"compressed-tensors format {fmt!r} is not supported for int weights "
                "(only 'pack-quantized', and 'int-quantized' for W8A8)"
            )
        sparsity = config.get("sparsity_config") or {}
        if sparsity and sparsity.get("format", "dense") != "dense":
            raise ValueError(
                f"compressed-tensors sparsity_config (format {sparsity.get('format')!r}) is not supported"
            )
        if config.get("transform_config"):
            raise ValueError("compressed-tensors transform_config (rotations) is not supported")
        raw = config.get("config_groups") or {}
        if not isinstance(raw, dict) or not raw:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        groups: list[tuple[list[str], IntWeightScheme]] = []
        for gname, g in raw.items():
            if not isinstance(g, dict):
                raise ValueError(f"compressed-tensors config_groups.{gname} must be an object")
            if fmt in (None, "mixed-precision") and g.get("format") is None:
                raise ValueError(
                    f"compressed-tensors config_groups.{gname}: no format (expected 'pack-quantized')"
                )
            if fmt not in (None, "mixed-precision") and g.get("format") not in (None, fmt):
                raise ValueError(
                    f"compressed-tensors config_groups.{gname}.format {g['format']!r} differs from the "
                    f"checkpoint's format {fmt!r} (expected 'mixed-precision' there)"
                )
            scheme = _int_scheme(gname, g, fmt)
            targets = list(g.get("targets") or [])
            if not targets:
                raise ValueError(f"compressed-tensors config_groups.{gname}: empty targets")
            groups.append((targets, scheme))
        kv = config.get("kv_cache_scheme")
        if kv and (
            int(kv.get("num_bits", 8)) != 8 or str(kv.get("type", "float")) != "float" or kv.get("dynamic")
        ):
            raise ValueError(f"compressed-tensors kv_cache_scheme {kv} is not supported (static FP8 only)")
        qc = cls(groups, list(config.get("ignore") or []), kv or None)
        if any(scheme.act_per_token for _, scheme in groups):
            qc.devices = ("cpu",)  # torch._int_mm per-token W8A8: the CPU path only, as quantization="int8"
        return qc

    def _scheme_for(self, name: str, by_class: bool = True) -> IntWeightScheme | None:
        # compressed-tensors' (and vLLM's) precedence, whatever the group order: a layer-name target,
        # then a "re:" one, then the class "Linear"; a target repeated in a later group is that group's.
        by_target = {served_name(t, self.key_map): scheme for targets, scheme in self.groups for t in targets}
        return target_lookup(name, by_target, by_class, self.key_map)

    def get_linear_method(self, prefix: str) -> QuantMethod:
        if is_skipped(
            prefix, served_names(self.ignore, self.key_map), self.packed_modules_mapping, self.key_map
        ):
            return UnquantizedLinearMethod()
        mixed = "its parts {parts} use different compressed-tensors schemes"
        scheme = target_fused_lookup(prefix, self.packed_modules_mapping, self._scheme_for, mixed)
        if scheme is None:
            return UnquantizedLinearMethod()
        if scheme.act_per_token:
            return CompressedTensorsW8A8LinearMethod()
        return CompressedTensorsWNA16LinearMethod(scheme)

    def __repr__(self) -> str:
        return f"CompressedTensorsWNA16Config(groups={self.groups}, ignore={self.ignore})"


def _check_zero_point(loaded: torch.Tensor, source: str) -> None:
    """A symmetric scheme's ``weight_zero_point``: older writers stored it (all zeros); 0.19 drops it."""
    if loaded.dtype.is_floating_point or bool(loaded.any()):
        raise ValueError(f"{source}: a symmetric scheme must have zero (or no) weight_zero_point")


def _repeat_word(value: int, bits: int) -> int:
    """The int32 word holding ``value`` in each of its ``32 / bits`` slots (two's complement)."""
    word = 0
    for j in range(32 // bits):
        word |= value << (bits * j)
    return word - (1 << 32) if word >= 1 << 31 else word


class CompressedTensorsWNA16LinearMethod(GPTQLinearMethod):
    """Loads pack-quantized tensors into GPTQ v2 parameters (see the module docstring); compute,
    LoRA and ``dequantized_weight`` are GPTQ's."""

    def __init__(self, scheme: IntWeightScheme) -> None:
        super().__init__(GPTQConfig(scheme.bits, scheme.group_size, scheme.g_idx, scheme.symmetric, 0, []))
        self.scheme = scheme

    def create_weights(
        self, layer: Linear, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        super().create_weights(layer, input_size, output_sizes, params_dtype)
        # Scales in the model dtype, as transformers and vLLM hold them (the product is taken in it).
        layer.scales.data = layer.scales.data.to(params_dtype)
        if self.scheme.symmetric:
            # Not in the checkpoint (no output_dim: the loader does not look for it): the constant
            # unsigned zero point 2**(bits-1) in every slot.
            bits = self.scheme.bits
            z = torch.full_like(layer.qzeros.data, _repeat_word(1 << (bits - 1), bits))
            layer.qzeros = nn.Parameter(z, requires_grad=False)

    def expected_tensors(self) -> tuple[str, ...]:
        names = ("weight_packed", "weight_scale", "weight_shape")
        if not self.scheme.symmetric:
            names += ("weight_zero_point",)
        return (*names, "weight_g_idx") if self.scheme.g_idx else names

    def load_weight(
        self, layer: Linear, name: str, loaded: torch.Tensor, shard: int | None, source: str
    ) -> None:
        if name == "weight_zero_point" and self.scheme.symmetric:
            _check_zero_point(loaded, source)
            return
        if name in ("weight_packed", "weight_zero_point"):
            if loaded.dtype != torch.int32 or loaded.dim() != 2:
                raise ValueError(
                    f"{source}: {name} must be a 2-D int32 tensor, got {loaded.dtype} {tuple(loaded.shape)}"
                )
            target = "qweight" if name == "weight_packed" else "qzeros"
            super().load_weight(layer, target, loaded.t(), shard, source)
        elif name == "weight_scale":
            if not loaded.dtype.is_floating_point or loaded.dim() not in (1, 2):
                raise ValueError(f"{source}: weight_scale must be a 1/2-D float tensor, got {loaded.dtype}")
            scale = loaded.view(-1, 1) if loaded.dim() == 1 else loaded
            QuantMethod.load_weight(self, layer, "scales", scale.t(), shard, source)  # no adopt_scales_dtype
        elif name == "weight_g_idx":
            super().load_weight(layer, "g_idx", loaded, shard, source)
        elif name == "weight_shape":
            rows = layer.output_size if shard is None else layer.output_sizes[shard]
            if loaded.numel() != 2 or [int(v) for v in loaded.reshape(-1)] != [rows, layer.input_size]:
                raise ValueError(
                    f"{source}: weight_shape {loaded.tolist()} does not match [{rows}, {layer.input_size}]"
                )
        else:
            QuantMethod.load_weight(self, layer, name, loaded, shard, source)


class CompressedTensorsW8A8LinearMethod(Int8LinearMethod):
    """A W8A8 group's linear: the checkpoint's int8 ``weight [out, in]`` and ``weight_scale
    [out, 1]`` as they are (no quantization at load), the int8 path's compute with
    compressed-tensors' activation scale, so the product is the checkpoint's own forward's
    (``q = clamp(round(x / (amax / 127.5)), -128, 127)``); LoRA deltas stay in float."""

    act_qmax = CT_INT8_HALF_RANGE

    def expected_tensors(self) -> tuple[str, ...]:
        return ("weight", "weight_scale")

    def load_weight(
        self, layer: Linear, name: str, loaded: torch.Tensor, shard: int | None, source: str
    ) -> None:
        if name == "weight":
            if loaded.dtype != torch.int8 or loaded.dim() != 2 or loaded.shape[1] != layer.input_size:
                raise ValueError(
                    f"{source}: a W8A8 weight must be int8 [*, {layer.input_size}], got {loaded.dtype} "
                    f"{tuple(loaded.shape)}"
                )
            load_shard(layer.weight, layer.output_sizes, loaded, shard, source)
        elif name == "weight_scale":
            per_channel = loaded.dim() == 1 or (loaded.dim() == 2 and loaded.shape[1] == 1)
            if not loaded.dtype.is_floating_point or not per_channel:
                raise ValueError(
                    f"{source}: weight_scale must be a per-channel float [out, 1], got {loaded.dtype} "
                    f"{tuple(loaded.shape)}"
                )
            scale = loaded.reshape(-1).float()
            load_shard(layer.weight_scale, layer.output_sizes, scale, shard, source, by_rows=True)
        elif name == "weight_zero_point":  # symmetric
            _check_zero_point(loaded, source)
        else:
            super().load_weight(layer, name, loaded, shard, source)


__all__ = [
    "CompressedTensorsW8A8LinearMethod",
    "CompressedTensorsWNA16Config",
    "CompressedTensorsWNA16LinearMethod",
    "IntWeightScheme",
    "is_int_weight_config",
]
