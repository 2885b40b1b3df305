"""FP8 (e4m3) weights: compressed-tensors checkpoints (llm-compressor), vLLM-style ``fp8`` checkpoints
and on-the-fly quantization of a 16-bit checkpoint (``quantization="fp8"``).

compressed-tensors ``float-quantized`` tensors per linear:
  ``weight``       ``[out, in]`` float8_e4m3fn
  ``weight_scale`` ``[out, 1]`` (strategy ``channel``) or ``[1]`` (strategy ``tensor``)
  ``input_scale``  ``[1]`` when the input activations are static (``dynamic: false``)
``W = weight * weight_scale``; the input is quantized as declared (per token / per tensor, dynamic or
static), so the layer computes exactly what transformers' compressed-tensors forward computes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lorastar.kernels.fp8 import (
    ACT_NONE,
    ACT_TENSOR_DYNAMIC,
    ACT_TENSOR_STATIC,
    ACT_TOKEN,
    FP8_DTYPE,
    fp8_linear,
    quantize_weight_per_channel,
)
from lorastar.layers.linear import (
    Linear,
    QuantMethod,
    UnquantizedLinearMethod,
    load_shard,
    mark_loaded,
    set_param_meta,
)
from lorastar.quant.base import QuantConfig
from lorastar.quant.utils import is_skipped, served_name, served_names, target_fused_lookup, target_lookup


class Fp8LinearMethod(QuantMethod):
    """One FP8 linear. ``weight_strategy``: ``"channel"`` or ``"tensor"`` (one scale per checkpoint
    shard); ``act``: one of ``kernels.fp8.ACT_*``; ``serialized=False`` quantizes float weights as
    they are loaded (per-channel scales), keeping only the fp8 copy."""

    def __init__(self, weight_strategy: str, act: str, serialized: bool) -> None:
        if weight_strategy not in ("channel", "tensor"):
            raise ValueError(f"FP8: weight strategy {weight_strategy!r} is not supported (channel or tensor)")
        self.weight_strategy = weight_strategy
        self.act = act
        self.serialized = serialized
        self.shard_input_scales: list[float] | None = None  # static scales that differ across shards

    def create_weights(
        self, layer: Linear, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        out, shards = sum(output_sizes), len(output_sizes)
        weight = nn.Parameter(torch.zeros(out, input_size, dtype=FP8_DTYPE), requires_grad=False)
        set_param_meta(weight, output_dim=0)
        layer.register_parameter("weight", weight)
        if not self.serialized:
            # Derived at load time (no output_dim: the loader does not look for it in the checkpoint).
            layer.register_parameter(
                "weight_scale", nn.Parameter(torch.ones(out, 1, dtype=torch.float32), requires_grad=False)
            )
        elif self.weight_strategy == "channel":
            ws = nn.Parameter(torch.ones(out, 1, dtype=torch.float32), requires_grad=False)
            set_param_meta(ws, output_dim=0)
            layer.register_parameter("weight_scale", ws)
        else:
            ws = nn.Parameter(torch.ones(shards, dtype=torch.float32), requires_grad=False)
            set_param_meta(ws, output_dim=None)
            layer.register_parameter("weight_scale", ws)
        if self.serialized and self.act == ACT_TENSOR_STATIC:
            xs = nn.Parameter(torch.ones(shards, dtype=torch.float32), requires_grad=False)
            set_param_meta(xs, output_dim=None)
            layer.register_parameter("input_scale", xs)
        # Per-output-row scale used by the matmul (per-tensor scales expanded over their shard).
        layer.register_buffer("fp8_row_scale", torch.ones(out, dtype=torch.float32), persistent=False)

    def expected_tensors(self) -> tuple[str, ...]:
        if not self.serialized:
            return ("weight",)
        if self.act == ACT_TENSOR_STATIC:
            return ("weight", "weight_scale", "input_scale")
        return ("weight", "weight_scale")

    def load_weight(
        self, layer: Linear, name: str, loaded: torch.Tensor, shard: int | None, source: str
    ) -> None:
        if name == "weight":
            if self.serialized:
                if loaded.dtype != FP8_DTYPE:
                    raise ValueError(f"{source}: FP8 weight must be float8_e4m3fn, got {loaded.dtype}")
                # Copy raw bytes: some fp8 copy/index ops are missing on CPU.
                load_shard(
                    layer.weight, layer.output_sizes, loaded.view(torch.uint8), shard, source, raw=True
                )
                return
            if not loaded.dtype.is_floating_point or loaded.element_size() == 1:
                raise ValueError(
                    f"{source}: on-the-fly FP8 needs a 16/32-bit float weight, got {loaded.dtype}"
                )
            if loaded.dim() != 2 or loaded.shape[1] != layer.input_size:
                raise ValueError(
                    f"{source}: shape {tuple(loaded.shape)} does not match [*, {layer.input_size}]"
                )
            wq, scale = quantize_weight_per_channel(loaded)  # per row: shard-wise quantization is exact
            load_shard(layer.weight, layer.output_sizes, wq.view(torch.uint8), shard, source, raw=True)
            load_shard(layer.weight_scale, layer.output_sizes, scale.view(-1, 1), shard, source, by_rows=True)
            return
        if name in ("weight_scale", "input_scale") and isinstance(getattr(layer, name, None), torch.Tensor):
            param = getattr(layer, name)
            if getattr(param, "output_dim", 0) is None:  # per-tensor: one scalar per shard
                if loaded.numel() != 1:
                    raise ValueError(
                        f"{source}: expected a per-tensor scale (1 element), got shape {tuple(loaded.shape)}"
                    )
                idx = 0 if shard is None else shard
                param.data[idx] = loaded.float().reshape(())
                mark_loaded(param, shard)
                return
            if loaded.dim() == 1:
                loaded = loaded.view(-1, 1)  # some writers drop the trailing 1 of [out, 1]
            super().load_weight(layer, name, loaded.float(), shard, source)
            return
        super().load_weight(layer, name, loaded, shard, source)

    def process_weights_after_loading(self, layer: Linear) -> None:
        ws = layer.weight_scale.data
        if self.weight_strategy == "tensor" and self.serialized:
            sizes = torch.tensor(layer.output_sizes, device=ws.device)
            rows = torch.repeat_interleave(ws.float(), sizes)  # [out]
        else:
            rows = ws.float().view(-1)
        if not bool(torch.all(rows > 0)) or not bool(torch.all(torch.isfinite(rows))):
            raise ValueError(f"{layer.prefix}.weight_scale: scales must be positive and finite")
        layer.fp8_row_scale.copy_(rows)
        if self.act == ACT_TENSOR_STATIC:
            xs = [float(v) for v in layer.input_scale.data]
            if any(not v > 0 for v in xs):
                raise ValueError(f"{layer.prefix}.input_scale: scales must be positive")
            # Fused shards with different static input scales are computed shard by shard (exactly
            # the declared scheme); equal ones share one quantized input.
            self.shard_input_scales = xs if len(set(xs)) > 1 else None

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        w, rows = layer.weight, layer.fp8_row_scale
        if self.shard_input_scales is None:
            xs = layer.input_scale[:1] if self.act == ACT_TENSOR_STATIC else None
            y = fp8_linear(x2, w, rows, act=self.act, input_scale=xs, bias=bias)
        else:
            offs = layer.slice_offsets()
            parts = []
            for i in range(len(layer.output_sizes)):
                lo, hi = offs[i], offs[i + 1]
                parts.append(
                    fp8_linear(
                        x2,
                        w[lo:hi],
                        rows[lo:hi],
                        act=self.act,
                        input_scale=layer.input_scale[i : i + 1],
                        bias=None if bias is None else bias[lo:hi],
                    )
                )
            y = torch.cat(parts, dim=-1)
        return y.reshape(*lead, y.shape[-1])

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        """``[out, in]`` fp32."""
        return layer.weight.float() * layer.fp8_row_scale.view(-1, 1)


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


def _act_from_args(args: dict[str, Any] | None, where: str) -> str:
    if args is None:
        return ACT_NONE
    if int(args.get("num_bits", 8)) != 8 or str(args.get("type", "float")) != "float":
        raise ValueError(
            f"compressed-tensors {where}: only 8-bit float activations are supported, got {args}"
        )
    if not args.get("symmetric", True):
        raise ValueError(f"compressed-tensors {where}: asymmetric FP8 activations are not supported")
    strategy = str(args.get("strategy", "tensor"))
    dynamic = args.get("dynamic", False)
    if strategy == "token" and dynamic is True:
        return ACT_TOKEN
    if strategy == "tensor" and dynamic is True:
        return ACT_TENSOR_DYNAMIC
    if strategy == "tensor" and dynamic is False:
        return ACT_TENSOR_STATIC
    raise ValueError(
        f"compressed-tensors {where}: activation strategy {strategy!r} with dynamic={dynamic!r} is not supported"
    )


def _weight_strategy(args: dict[str, Any] | None, where: str) -> str:
    if not args:
        raise ValueError(f"compressed-tensors {where}: no 'weights' scheme")
    if int(args.get("num_bits", 0)) != 8 or str(args.get("type", "")) != "float":
        raise ValueError(
            f"compressed-tensors {where}: only FP8 weights (num_bits=8, type=float) are supported, "
            f"got num_bits={args.get('num_bits')} type={args.get('type')}"
        )
    if not args.get("symmetric", True) or args.get("dynamic", False):
        raise ValueError(f"compressed-tensors {where}: only static symmetric FP8 weights are supported")
    strategy = str(args.get("strategy", "tensor"))
    if strategy not in ("tensor", "channel"):
        raise ValueError(
            f"compressed-tensors {where}: weight strategy {strategy!r} is not supported (tensor/channel)"
        )
    return strategy


class CompressedTensorsFp8Config(QuantConfig):
    """llm-compressor's FP8 schemes (``FP8``: per-tensor static; ``FP8_DYNAMIC``: per-channel weights,
    per-token dynamic inputs; weight-only ``FP8`` variants too)."""

    name = "fp8"

    def __init__(
        self,
        groups: list[tuple[list[str], str, str]],
        ignore: list[str],
        kv_cache_scheme: dict[str, Any] | None,
    ) -> None:
        self.groups = groups  # (targets, weight strategy, activation mode)
        self.ignore = ignore
        self.kv_cache_scheme = kv_cache_scheme

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsFp8Config:
        fmt = str(config.get("format", "float-quantized"))
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ValueError(
                f"compressed-tensors format {fmt!r} is not supported (only FP8 'float-quantized')"
            )
        groups = []
        for gname, g in (config.get("config_groups") or {}).items():
            if g.get("output_activations"):
                raise ValueError(
                    f"compressed-tensors {gname}: output activation quantization is not supported"
                )
            w = _weight_strategy(g.get("weights"), gname)
            a = _act_from_args(g.get("input_activations"), gname)
            targets = list(g.get("targets") or [])
            if not targets:
                raise ValueError(f"compressed-tensors {gname}: empty targets")
            groups.append((targets, w, a))
        if not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        kv = config.get("kv_cache_scheme")
        if kv:
            if (
                int(kv.get("num_bits", 8)) != 8
                or str(kv.get("type", "float")) != "float"
                or kv.get("dynamic")
            ):
                raise ValueError(
                    f"compressed-tensors kv_cache_scheme {kv} is not supported (static FP8 only)"
                )
        return cls(groups, list(config.get("ignore") or []), kv or None)

    def _scheme_for(self, name: str, by_class: bool = True) -> tuple[str, str] | None:
        # Targets name the checkpoint's layers; precedence as compressed-tensors' (utils.target_lookup).
        by_target = {served_name(t, self.key_map): (w, a) for targets, w, a in self.groups for t in targets}
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
        return Fp8LinearMethod(scheme[0], scheme[1], serialized=True)

    def __repr__(self) -> str:
        return f"CompressedTensorsFp8Config(groups={self.groups}, kv_cache_scheme={self.kv_cache_scheme})"


class Fp8CheckpointConfig(QuantConfig):
    """``quant_method: fp8`` checkpoints (vLLM / transformers style): per-tensor ``weight_scale``,
    ``activation_scheme`` dynamic (per token here) or static (``input_scale``). Block-wise
    (``weight_block_size``) checkpoints are not supported."""

    name = "fp8"

    def __init__(self, act: str, ignore: list[str]) -> None:
        self.act = act
        self.ignore = ignore

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8CheckpointConfig:
        if config.get("weight_block_size"):
            raise ValueError("fp8 checkpoints with weight_block_size (block-wise scales) are not supported")
        scheme = str(config.get("activation_scheme", "dynamic"))
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 activation_scheme must be 'dynamic' or 'static', got {scheme!r}")
        ignore = list(config.get("ignored_layers") or config.get("modules_to_not_convert") or [])
        return cls(ACT_TOKEN if scheme == "dynamic" else ACT_TENSOR_STATIC, ignore)

    def get_linear_method(self, prefix: str) -> QuantMethod:
        if is_skipped(
            prefix, served_names(self.ignore, self.key_map), self.packed_modules_mapping, self.key_map
        ):
            return UnquantizedLinearMethod()
        return Fp8LinearMethod("tensor", self.act, serialized=True)


class Fp8OnTheFlyConfig(QuantConfig):
    """``quantization="fp8"`` on a 16/32-bit checkpoint: per-channel e4m3 weights quantized while
    loading, per-token dynamic activation quantization (W8A8, like FP8_DYNAMIC)."""

    name = "fp8"

    def __init__(self, act: str = ACT_TOKEN) -> None:
        self.act = act

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8OnTheFlyConfig:
        return cls()

    def get_linear_method(self, prefix: str) -> QuantMethod:
        return Fp8LinearMethod("channel", self.act, serialized=False)

    def __repr__(self) -> str:
        return f"Fp8OnTheFlyConfig(act={self.act!r})"
