"""compressed-tensors pack-quantized int checkpoints built here from tiny random models (every linear
quantized by the format's definition, written as llm-compressor lays it out), loaded through the
engine loader and compared with the same model holding the dequantized weights as plain floats."""

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

from lorastar.quant import get_quant_config
from lorastar.quant.compressed_int import CompressedTensorsWNA16LinearMethod
from tests.conftest import prefill_logits

loader = pytest.importorskip("lorastar.models.loader", reason="engine loader not available")

Scheme = tuple[int, int, bool]  # bits, group size (-1: channel), symmetric
_LINEAR = re.compile(r"(q|k|v|o|gate|up|down|qkv|gate_up)_proj\.weight$")


def _pack(u: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    per = 32 // bits
    v = u.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, per) << (torch.arange(per) * bits)
    words = v.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).movedim(-1, dim).contiguous()


def _quantize(w: torch.Tensor, scheme: Scheme) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(checkpoint tensors, dequantized weight) of ``w`` ``[n, k]``."""
    bits, gs, sym = scheme
    n, k = w.shape
    gs = k if gs == -1 else gs
    groups = -(-k // gs)
    half = 1 << (bits - 1)
    g_of = torch.arange(k) // gs
    w = w.float()
    lo = torch.stack([w[:, g_of == g].amin(1) for g in range(groups)], 1)
    hi = torch.stack([w[:, g_of == g].amax(1) for g in range(groups)], 1)
    if sym:
        s = torch.maximum(lo.abs(), hi.abs()) / (half - 1) + 1e-8
        z = torch.zeros(n, groups, dtype=torch.int64)
    else:
        s = (hi - lo) / (2 * half - 1) + 1e-8
        z = (torch.round(-lo / s) - half).clamp(-half, half - 1).long()
    q = (torch.round(w / s[:, g_of]) + z[:, g_of]).clamp(-half, half - 1).long()
    deq = (q - z[:, g_of]).float() * s[:, g_of]
    t = {"weight_packed": _pack(q + half, bits, 1), "weight_scale": s, "weight_shape": torch.tensor([n, k])}
    if not sym:
        t["weight_zero_point"] = _pack(z + half, bits, 0)
    return t, deq


def _write_pair(
    src: str, out: Path, scheme_of: Callable[[str], Scheme | None], qconfig: dict[str, Any]
) -> tuple[Path, Path]:
    """``out/q``: ``src`` with the linears ``scheme_of`` (checkpoint module name -> scheme) names
    quantized and ``qconfig`` as its quantization_config; ``out/ref``: the dequantized floats."""
    qdir, rdir = out / "q", out / "ref"
    for d in (qdir, rdir):
        shutil.copytree(src, d)
    tensors = load_file(str(Path(src) / "model.safetensors"))
    qt: dict[str, torch.Tensor] = {}
    rt: dict[str, torch.Tensor] = {}
    for name, v in tensors.items():
        module = name.removesuffix(".weight")
        scheme = scheme_of(module) if _LINEAR.search(name) else None
        if scheme is None:
            qt[name] = rt[name] = v
            continue
        packed, deq = _quantize(v, scheme)
        qt.update({f"{module}.{k}": t for k, t in packed.items()})
        rt[name] = deq.to(v.dtype)
    save_file(qt, str(qdir / "model.safetensors"))
    save_file(rt, str(rdir / "model.safetensors"))
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (qdir / "config.json").write_text(json.dumps(cfg))
    return qdir, rdir


def _group(scheme: Scheme, targets: list[str]) -> dict[str, Any]:
    bits, gs, sym = scheme
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False, "actorder": None,
               "strategy": "channel" if gs == -1 else "group", "group_size": None if gs == -1 else gs}  # fmt: skip
    return {"targets": targets, "weights": weights, "input_activations": None, "format": "pack-quantized"}


def _qconfig(groups: list[dict[str, Any]], ignore: list[str]) -> dict[str, Any]:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {f"group_{i}": g for i, g in enumerate(groups)}, "ignore": ignore,
            "sparsity_config": {}, "transform_config": {}, "kv_cache_scheme": None}  # fmt: skip


def _load(path: Path):  # noqa: ANN202
    cfg = loader.read_hf_config(path)
    qc = get_quant_config(cfg, None, torch.float32)
    model, _ = loader.load_model(
        path, cfg, dtype=torch.float32, device=torch.device("cpu"), quant=qc, max_positions=64
    )
    return model


def _assert_same_logits(qdir: Path, rdir: Path) -> Any:  # noqa: ANN401
    qmodel, rmodel = _load(qdir), _load(rdir)
    ids = [1, 5, 9, 17, 33, 2, 8]
    torch.testing.assert_close(prefill_logits(qmodel, ids), prefill_logits(rmodel, ids), atol=2e-4, rtol=2e-4)
    return qmodel


W4: Scheme = (4, 16, True)
W8: Scheme = (8, -1, True)


def test_layer_name_and_regex_targets_win_over_linear_whatever_the_group_order(
    tiny_model_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """llm-compressor mixed precision: group_0 ``Linear`` W4A16, group_1 ``re:.*down_proj`` W8A16 (and
    one layer named exactly). compressed-tensors (``match_targets``) and vLLM
    (``find_matched_target``) give a layer the scheme of a name / regex target before a class one."""

    def scheme_of(module: str) -> Scheme:
        return W8 if module.endswith("down_proj") or module == "model.layers.0.self_attn.o_proj" else W4

    groups = [_group(W4, ["Linear"]), _group(W8, ["re:.*down_proj", "model.layers.0.self_attn.o_proj"])]
    qdir, rdir = _write_pair(tiny_model_dir("llama-gqa"), tmp_path, scheme_of, _qconfig(groups, ["lm_head"]))
    model = _assert_same_logits(qdir, rdir)
    layer = model.layers[0]
    assert isinstance(layer.mlp.down_proj.quant_method, CompressedTensorsWNA16LinearMethod)
    assert layer.mlp.down_proj.quant_method.scheme.bits == 8
    assert layer.self_attn.o_proj.quant_method.scheme.bits == 8
    assert model.layers[1].self_attn.o_proj.quant_method.scheme.bits == 4


def test_a_multimodal_checkpoint_names_its_layers_as_the_checkpoint_does(
    tiny_model_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """Mistral 3 (LLaVA layout): ``ignore`` and layer-name targets use the checkpoint's module names
    (``language_model.model.layers.N...``), which the served model calls ``model.layers.N...``
    (vLLM maps them through the model's ``hf_to_vllm_mapper``)."""
    skipped = "language_model.model.layers.0.mlp.down_proj"
    eight = "language_model.model.layers.1.self_attn.o_proj"

    def scheme_of(module: str) -> Scheme | None:
        if module.startswith(("vision_tower.", "multi_modal_projector.")) or module == skipped:
            return None
        return W8 if module == eight else W4

    groups = [_group(W4, ["Linear"]), _group(W8, [eight])]
    ignore = ["language_model.lm_head", "re:vision_tower.*", "re:multi_modal_projector.*", skipped]
    qdir, rdir = _write_pair(tiny_model_dir("mistral3-mm"), tmp_path, scheme_of, _qconfig(groups, ignore))
    model = _assert_same_logits(qdir, rdir)
    assert not isinstance(model.layers[0].mlp.down_proj.quant_method, CompressedTensorsWNA16LinearMethod)
    assert model.layers[1].self_attn.o_proj.quant_method.scheme.bits == 8


def test_a_fused_checkpoint_module_named_by_a_target_wins_over_linear(
    tiny_model_dir: Callable[[str], str], tmp_path: Path
) -> None:
    """Phi-3 stores qkv_proj / gate_up_proj fused: a config naming them (``re:.*qkv_proj``) gives them
    that group's scheme although the parts the engine also looks up (q/k/v_proj) match ``Linear``."""

    def scheme_of(module: str) -> Scheme:
        return W8 if module.endswith(("qkv_proj", "model.layers.1.mlp.gate_up_proj")) else W4

    groups = [
        _group(W4, ["Linear"]),
        _group(W8, ["re:.*self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"]),
    ]
    qdir, rdir = _write_pair(tiny_model_dir("phi3"), tmp_path, scheme_of, _qconfig(groups, ["lm_head"]))
    model = _assert_same_logits(qdir, rdir)
    assert model.layers[0].self_attn.qkv_proj.quant_method.scheme.bits == 8
    assert model.layers[0].mlp.gate_up_proj.quant_method.scheme.bits == 4
    assert model.layers[1].mlp.gate_up_proj.quant_method.scheme.bits == 8
