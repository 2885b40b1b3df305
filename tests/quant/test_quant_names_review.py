"""Layer names in the quantization configs other than compressed-tensors int (FP8 compressed-tensors,
vLLM-style fp8, AWQ, GPTQ): target precedence, fused checkpoint modules, and skip lists that name the
checkpoint's layers (a multimodal checkpoint's ``language_model.model.*``, served as ``model.*``).
Each test writes a tiny synthetic checkpoint and loads it through the engine loader."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorastar.kernels.fp8 import ACT_TENSOR_STATIC, ACT_TOKEN, FP8_DTYPE
from lorastar.layers.linear import UnquantizedLinearMethod
from lorastar.quant import get_quant_config
from lorastar.quant.awq import AWQLinearMethod
from lorastar.quant.fp8 import Fp8LinearMethod
from lorastar.quant.gptq import GPTQConfig, GPTQLinearMethod

loader = pytest.importorskip("lorastar.models.loader", reason="engine loader not available")

_LINEAR = re.compile(r"(q|k|v|o|gate|up|down|qkv|gate_up)_proj\.weight$")
Tensors = dict[str, torch.Tensor]
MM_SKIP = ("vision_tower.", "multi_modal_projector.")


def _fp8(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    amax = w.float().abs().amax(1, keepdim=True) if per_channel else w.float().abs().amax().view(1)
    scale = amax.clamp_min(1e-6) / torch.finfo(FP8_DTYPE).max
    q = (w.float() / (scale if per_channel else scale[0])).to(FP8_DTYPE)
    return q, scale


def fp8_channel(w: torch.Tensor) -> Tensors:
    q, s = _fp8(w, True)
    return {"weight": q, "weight_scale": s}


def fp8_tensor_static(w: torch.Tensor) -> Tensors:
    q, s = _fp8(w, False)
    return {"weight": q, "weight_scale": s, "input_scale": torch.tensor([0.05])}


def fp8_tensor(w: torch.Tensor) -> Tensors:
    q, s = _fp8(w, False)
    return {"weight": q, "weight_scale": s[0]}


def awq(w: torch.Tensor, g: int = 32) -> Tensors:
    n, k = w.shape
    return {
        "qweight": torch.randint(-(2**31), 2**31 - 1, (k, n // 8), dtype=torch.int32),
        "qzeros": torch.full((k // g, n // 8), 0x88888888 - 2**32, dtype=torch.int32),
        "scales": torch.full((k // g, n), 0.01, dtype=torch.float16),
    }


def gptq(w: torch.Tensor, g: int = 32) -> Tensors:
    n, k = w.shape
    return {
        "qweight": torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32),
        "qzeros": torch.full((k // g, n // 8), 0x77777777, dtype=torch.int32),
        "scales": torch.full((k // g, n), 0.01, dtype=torch.float16),
        "g_idx": torch.arange(k, dtype=torch.int32) // g,
    }


def _write(
    src: str, out: Path, quantize: Callable[[str], Callable[[torch.Tensor], Tensors] | None], qc: dict
) -> Path:
    """``src`` with each linear that ``quantize`` (checkpoint module name -> writer) names quantized."""
    shutil.copytree(src, out)
    tensors: Tensors = {}
    for name, v in load_file(str(Path(src) / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        write = quantize(module) if _LINEAR.search(name) else None
        if write is None:
            tensors[name] = v
        else:
            tensors.update({f"{module}.{k}": t for k, t in write(v).items()})
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _load(path: Path):  # noqa: ANN202
    cfg = loader.read_hf_config(path)
    qc = get_quant_config(cfg, None, torch.float16)
    model, _ = loader.load_model(
        path, cfg, dtype=torch.float16, device=torch.device("cpu"), quant=qc, max_positions=64
    )
    return model


def _ct_fp8(groups: list[tuple[list[str], bool]], ignore: list[str]) -> dict[str, Any]:
    """compressed-tensors FP8 config: each group (targets, static per-tensor) else FP8_DYNAMIC."""

    def group(targets: list[str], static: bool) -> dict[str, Any]:
        w = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
             "strategy": "tensor" if static else "channel"}  # fmt: skip
        a = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
             "strategy": "tensor" if static else "token"}  # fmt: skip
        return {"targets": targets, "weights": w, "input_activations": a, "format": "float-quantized"}

    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {f"group_{i}": group(*g) for i, g in enumerate(groups)}, "ignore": ignore,
            "kv_cache_scheme": None}  # fmt: skip


def _act(layer: torch.nn.Module) -> str:
    method = layer.quant_method
    assert isinstance(method, Fp8LinearMethod)
    return method.act


def test_fp8_name_and_regex_targets_win_over_linear_whatever_the_group_order(
    tiny_model_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """Group 0 ``Linear`` FP8_DYNAMIC, group 1 ``re:.*down_proj`` + one layer name static FP8: vLLM's
    ``find_matched_target`` (and compressed-tensors) give those layers group 1's scheme."""
    named = "model.layers.0.self_attn.o_proj"

    def quantize(module: str) -> Callable[[torch.Tensor], Tensors]:
        return fp8_tensor_static if module.endswith("down_proj") or module == named else fp8_channel

    qc = _ct_fp8([(["Linear"], False), (["re:.*down_proj", named], True)], ["lm_head"])
    model = _load(_write(tiny_model_dir("llama-gqa"), tmp_path / "q", quantize, qc))
    assert _act(model.layers[0].mlp.down_proj) == ACT_TENSOR_STATIC
    assert _act(model.layers[0].self_attn.o_proj) == ACT_TENSOR_STATIC
    assert _act(model.layers[1].self_attn.o_proj) == ACT_TOKEN
    assert _act(model.layers[1].mlp.gate_up_proj) == ACT_TOKEN


def test_fp8_fused_checkpoint_module_named_by_a_target_wins_over_linear(
    tiny_model_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """Phi-3 stores qkv_proj fused: ``re:.*qkv_proj`` names it, though its parts match ``Linear``."""

    def quantize(module: str) -> Callable[[torch.Tensor], Tensors]:
        return fp8_tensor_static if module.endswith("qkv_proj") else fp8_channel

    qc = _ct_fp8([(["Linear"], False), (["re:.*self_attn.qkv_proj"], True)], ["lm_head"])
    model = _load(_write(tiny_model_dir("phi3"), tmp_path / "q", quantize, qc))
    assert _act(model.layers[0].self_attn.qkv_proj) == ACT_TENSOR_STATIC
    assert _act(model.layers[0].mlp.gate_up_proj) == ACT_TOKEN


def test_fp8_compressed_tensors_multimodal_checkpoint_names(
    tiny_model_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """Mistral 3: ``ignore`` and name targets are the checkpoint's ``language_model.model.*`` names."""
    skipped = "language_model.model.layers.0.mlp.down_proj"
    static = "language_model.model.layers.1.self_attn.o_proj"

    def quantize(module: str) -> Callable[[torch.Tensor], Tensors] | None:
        if module.startswith(MM_SKIP) or module == skipped:
            return None
        return fp8_tensor_static if module == static else fp8_channel

    ignore = ["language_model.lm_head", "re:vision_tower.*", "re:multi_modal_projector.*", skipped]
    qc = _ct_fp8([(["Linear"], False), ([static], True)], ignore)
    model = _load(_write(tiny_model_dir("mistral3-mm"), tmp_path / "q", quantize, qc))
    assert isinstance(model.layers[0].mlp.down_proj.quant_method, UnquantizedLinearMethod)
    assert _act(model.layers[1].self_attn.o_proj) == ACT_TENSOR_STATIC
    assert _act(model.layers[0].self_attn.o_proj) == ACT_TOKEN


def test_fp8_checkpoint_ignored_layers_name_the_checkpoint_layers(
    tiny_model_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """vLLM-style ``fp8`` checkpoint: ``ignored_layers`` mapped like vLLM's ``Fp8Config.apply_vllm_mapper``."""
    ignored = [f"language_model.model.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]

    def quantize(module: str) -> Callable[[torch.Tensor], Tensors] | None:
        return None if module.startswith(MM_SKIP) or module in ignored else fp8_tensor

    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": [*ignored, "vision_tower"]}
    model = _load(_write(tiny_model_dir("mistral3-mm"), tmp_path / "q", quantize, qc))
    assert isinstance(model.layers[1].self_attn.qkv_proj.quant_method, UnquantizedLinearMethod)
    assert _act(model.layers[0].self_attn.qkv_proj) == ACT_TOKEN


def test_awq_modules_to_not_convert_name_the_checkpoint_layers(
    tiny_model_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """AWQ ``modules_to_not_convert`` (vLLM's ``AWQConfig.apply_vllm_mapper`` maps it)."""
    kept = "language_model.model.layers.0.mlp"

    def quantize(module: str) -> Callable[[torch.Tensor], Tensors] | None:
        return None if module.startswith((*MM_SKIP, kept + ".")) else awq

    qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
          "modules_to_not_convert": ["vision_tower", "multi_modal_projector", kept]}  # fmt: skip
    model = _load(_write(tiny_model_dir("mistral3-mm"), tmp_path / "q", quantize, qc))
    assert isinstance(model.layers[0].mlp.down_proj.quant_method, UnquantizedLinearMethod)
    assert isinstance(model.layers[0].mlp.gate_up_proj.quant_method, UnquantizedLinearMethod)
    assert isinstance(model.layers[1].mlp.down_proj.quant_method, AWQLinearMethod)


def test_gptq_skip_lists_name_the_checkpoint_layers(
    tiny_model_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """GPTQ ``modules_to_not_convert`` and ``modules_in_block_to_quantize`` (vLLM's
    ``GPTQConfig.apply_vllm_mapper`` maps the latter) name the checkpoint's layers."""
    skipped = "language_model.model.layers.1.mlp.down_proj"

    def quantize(module: str) -> Callable[[torch.Tensor], Tensors] | None:
        return None if module.startswith(MM_SKIP) or module == skipped else gptq

    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
          "checkpoint_format": "gptq", "modules_to_not_convert": [skipped]}  # fmt: skip
    model = _load(_write(tiny_model_dir("mistral3-mm"), tmp_path / "q", quantize, qc))
    assert isinstance(model.layers[1].mlp.down_proj.quant_method, UnquantizedLinearMethod)
    assert isinstance(model.layers[0].mlp.down_proj.quant_method, GPTQLinearMethod)

    in_block = ["language_model.model.layers.0.self_attn.o_proj"]
    config = GPTQConfig.from_config({"bits": 4, "group_size": 32, "modules_in_block_to_quantize": [in_block]})
    config.key_map = type(model).key_map
    assert isinstance(config.get_linear_method("model.layers.0.self_attn.o_proj"), GPTQLinearMethod)
    assert isinstance(config.get_linear_method("model.layers.0.mlp.down_proj"), UnquantizedLinearMethod)
