"""Quantized weights and KV cache: AWQ, GPTQ, FP8 (compressed-tensors or on the fly), compressed-tensors
int4/int8 weight-only (W4A16 / W8A16, served as GPTQ) and int8 W8A8 (CPU), int8 W8A8 on the fly (CPU),
FP8 KV.

``get_quant_config`` is the one entry point the loader uses: the method comes from the checkpoint's
``config.json`` (``quantization_config.quant_method``), never from file names; ``requested`` (the
engine's ``quantization=``) forces on-the-fly FP8 or int8 for a 16-bit checkpoint or checks the checkpoint.
A compressed-tensors checkpoint answers to ``"compressed-tensors"`` (vLLM's name) whatever its scheme;
an FP8 one also to ``"fp8"``, an int weight-only one to nothing else (not ``"gptq"``: that checks for a
GPTQ checkpoint).
"""

from __future__ import annotations

from typing import Any

import torch

from lorastar.layers.linear import QuantMethod, UnquantizedLinearMethod, set_param_meta
from lorastar.quant.base import QuantConfig
from lorastar.quant.kv_cache import KVScales, kv_cache_torch_dtype, parse_kv_scale_key, resolve_kv_scales

__all__ = [
    "KVScales",
    "QuantConfig",
    "QuantMethod",
    "UnquantizedLinearMethod",
    "get_quant_config",
    "kv_cache_torch_dtype",
    "parse_kv_scale_key",
    "resolve_kv_scales",
    "set_param_meta",
]

# quant_method in config.json -> the name users pass as ``quantization=``.
_METHOD_NAMES = {"awq": "awq", "gptq": "gptq", "compressed-tensors": "fp8", "fp8": "fp8"}
_REQUESTABLE = ("awq", "gptq", "fp8", "int8", "compressed-tensors")


def get_quant_config(
    hf_config: dict[str, Any], requested: str | None, model_dtype: torch.dtype
) -> QuantConfig | None:
    """The checkpoint's quantization scheme (``None``: a plain 16/32-bit checkpoint)."""
    if requested is not None and requested not in _REQUESTABLE:
        raise ValueError(f"quantization must be one of {_REQUESTABLE} or None, got {requested!r}")
    # Older compressed-tensors checkpoints used the key "compression_config".
    qc = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if not qc:
        if requested is None:
            return None
        if requested == "fp8":
            if model_dtype not in (torch.float16, torch.bfloat16, torch.float32):
                raise ValueError(f"quantization='fp8' needs a float model dtype, got {model_dtype}")
            from lorastar.quant.fp8 import Fp8OnTheFlyConfig

            return Fp8OnTheFlyConfig()
        if requested == "int8":
            if model_dtype not in (torch.float16, torch.bfloat16, torch.float32):
                raise ValueError(f"quantization='int8' needs a float model dtype, got {model_dtype}")
            from lorastar.quant.int8 import Int8OnTheFlyConfig

            return Int8OnTheFlyConfig()
        raise ValueError(
            f"quantization={requested!r} was requested but the checkpoint is not quantized "
            "(config.json has no quantization_config)"
        )
    if not isinstance(qc, dict):
        raise ValueError(f"config.json quantization_config must be an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    if method not in _METHOD_NAMES:
        raise ValueError(
            f"unsupported quantization_config.quant_method {method!r} (supported: {sorted(_METHOD_NAMES)})"
        )
    detected = _METHOD_NAMES[method]
    if method == "compressed-tensors":
        from lorastar.quant.compressed_int import is_int_weight_config

        if requested == "compressed-tensors" or is_int_weight_config(qc):
            detected = "compressed-tensors"
    if requested is not None and requested != detected:
        raise ValueError(
            f"quantization={requested!r} was requested but the checkpoint is quantized with "
            f"{method!r} ({detected!r})"
        )
    if method == "awq":
        from lorastar.quant.awq import AWQConfig

        return AWQConfig.from_config(qc)
    if method == "gptq":
        from lorastar.quant.gptq import GPTQConfig

        return GPTQConfig.from_config(qc)
    from lorastar.quant.fp8 import CompressedTensorsFp8Config, Fp8CheckpointConfig

    if method == "compressed-tensors":
        if is_int_weight_config(qc):
            from lorastar.quant.compressed_int import CompressedTensorsWNA16Config

            return CompressedTensorsWNA16Config.from_config(qc)
        return CompressedTensorsFp8Config.from_config(qc)
    return Fp8CheckpointConfig.from_config(qc)
