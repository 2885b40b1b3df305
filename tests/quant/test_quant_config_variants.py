"""quantization_config variants real checkpoints carry, on the committed fixtures: each fixture is
rewritten the way a checkpoint with that setting is laid out (tensors and config), then loaded and
compared with the logits transformers recorded for the original fixture (the rewrite leaves the
computed function unchanged), or checked to fail with an error naming the setting."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from quant_fixtures import checkpoint, fixture_dir, have_fixture, read_config, reference
from safetensors.torch import save_file
from test_quant_e2e import INT4_TOL, _forward_logits

from lorastar.kernels import reference as R
from lorastar.quant import get_quant_config

loader = pytest.importorskip("lorastar.models.loader", reason="engine loader not available")


def _need(name: str) -> None:
    if not have_fixture(name):
        pytest.skip(f"fixture {name} not committed")


def _rewrite(
    name: str,
    out: Path,
    qc_update: dict[str, Any],
    transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
) -> dict[str, Any]:
    """Write fixture ``name`` to ``out`` with ``qc_update`` merged into its quantization_config and
    its tensors passed through ``transform``; returns the new config."""
    cfg = read_config(name)
    cfg["quantization_config"] = {**cfg["quantization_config"], **qc_update}
    out.mkdir(parents=True, exist_ok=True)
    save_file(transform(checkpoint(name)), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return cfg


def _load_dir(d: Path, cfg: dict[str, Any]):  # noqa: ANN202
    model, _ = loader.load_model(
        d, cfg, dtype=torch.float32, device=torch.device("cpu"),
        quant=get_quant_config(cfg, None, torch.float32), max_positions=256,
    )  # fmt: skip
    return model


def _max_logit_error(model, name: str) -> float:  # noqa: ANN001
    ref = reference(name)
    worst = 0.0
    for i in range(ref["input_ids"].shape[0]):
        n = int(ref["seq_len"][i])
        want = ref["logits"][i, :n]
        got = _forward_logits(model, ref["input_ids"][i, :n].tolist())
        worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    return worst


def _gptq_dequantize_modules(
    tensors: dict[str, torch.Tensor], modules: list[str], bits: int = 4
) -> dict[str, torch.Tensor]:
    """Store ``modules`` as plain float weights (their exact GPTQ dequantization), as a checkpoint
    that leaves them unquantized does."""
    t = dict(tensors)
    for m in modules:
        w = R.ref_gptq_dequant(
            t.pop(f"{m}.qweight"), t.pop(f"{m}.qzeros"), t.pop(f"{m}.scales"), t.pop(f"{m}.g_idx"), bits
        )
        t[f"{m}.weight"] = w.t().contiguous()  # [out, in]
    return t


# ---------------------------------------------------------------------------------------------
# GPTQ
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nested", [True, False])
def test_gptq_modules_in_block_to_quantize_leaves_the_others_unquantized(
    tmp_path: Path, nested: bool
) -> None:
    """optimum / transformers quantize only the block modules listed there; the others are stored as
    plain ``weight`` tensors and must load as such (was: "unexpected tensor 'weight'")."""
    _need("gptq_act")
    listed = [["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"], ["self_attn.o_proj"],
              ["mlp.up_proj", "mlp.gate_proj"]]  # fmt: skip
    value = listed if nested else sum(listed, [])
    plain = [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    cfg = _rewrite(
        "gptq_act", tmp_path, {"modules_in_block_to_quantize": value},
        lambda t: _gptq_dequantize_modules(t, plain),
    )  # fmt: skip
    model = _load_dir(tmp_path, cfg)
    kinds = {p: type(lin.quant_method).__name__ for p, lin in model.linears().items()}
    assert kinds["model.layers.0.mlp.down_proj"] == "UnquantizedLinearMethod"
    assert kinds["model.layers.0.self_attn.qkv_proj"] == "GPTQLinearMethod"
    assert kinds["model.layers.1.mlp.gate_up_proj"] == "GPTQLinearMethod"
    err = _max_logit_error(model, "gptq_act")
    assert err < INT4_TOL, f"logits differ by {err:.2e} relative"


def test_gptq_modules_in_block_to_quantize_partial_fused_layer_is_an_error() -> None:
    cfg = {"quant_method": "gptq", "bits": 4, "group_size": 32,
           "modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj"]]}  # fmt: skip
    qc = get_quant_config({"quantization_config": cfg}, None, torch.float32)
    from lorastar.models.llama import LlamaForCausalLM

    qc.packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    with pytest.raises(ValueError, match="modules_in_block_to_quantize"):
        qc.get_linear_method("model.layers.0.self_attn.qkv_proj")
    assert type(qc.get_linear_method("model.layers.0.mlp.down_proj")).__name__ == "UnquantizedLinearMethod"


def test_gptq_without_act_order_loads_without_g_idx(tmp_path: Path) -> None:
    """Without act-order ``g_idx`` is the identity grouping; checkpoints that omit it load (gptqmodel
    and vLLM start from that default) instead of failing on the missing tensor."""
    _need("gptq_sym")
    assert not read_config("gptq_sym")["quantization_config"]["desc_act"]
    cfg = _rewrite(
        "gptq_sym", tmp_path, {}, lambda t: {k: v for k, v in t.items() if not k.endswith(".g_idx")}
    )
    err = _max_logit_error(_load_dir(tmp_path, cfg), "gptq_sym")
    assert err < INT4_TOL, f"logits differ by {err:.2e} relative"


def test_gptq_act_order_still_requires_g_idx(tmp_path: Path) -> None:
    _need("gptq_act")
    cfg = _rewrite(
        "gptq_act", tmp_path, {}, lambda t: {k: v for k, v in t.items() if not k.endswith(".g_idx")}
    )
    with pytest.raises(ValueError, match=r"missing tensor.*g_idx"):
        _load_dir(tmp_path, cfg)


# ---------------------------------------------------------------------------------------------
# Skip lists and targets naming a fused module (checkpoints that store it fused: Phi-3)
# ---------------------------------------------------------------------------------------------

_FP8_CHANNEL = {"num_bits": 8, "type": "float", "strategy": "channel"}
# case -> (quantization_config, method of qkv_proj, method of down_proj)
_FUSED_NAME_CASES = {
    "awq-skip": ({"quant_method": "awq", "bits": 4, "group_size": 32,
                  "modules_to_not_convert": ["model.layers.0.self_attn.qkv_proj"]}, "Unquantized", "AWQ"),
    "gptq-skip": ({"quant_method": "gptq", "bits": 4, "group_size": 32,
                   "modules_to_not_convert": ["self_attn.qkv_proj"]}, "Unquantized", "GPTQ"),
    "gptq-in-block": ({"quant_method": "gptq", "bits": 4, "group_size": 32,
                       "modules_in_block_to_quantize": [["self_attn.qkv_proj"]]}, "GPTQ", "Unquantized"),
    "fp8-ignored": ({"quant_method": "fp8", "ignored_layers": ["model.layers.0.self_attn.qkv_proj"]},
                    "Unquantized", "Fp8"),
    "ct-ignore": ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["re:.*qkv_proj$"],
                   "config_groups": {"g": {"targets": ["Linear"], "weights": _FP8_CHANNEL}}}, "Unquantized", "Fp8"),
    "ct-targets": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                    "config_groups": {"g": {"targets": ["re:.*qkv_proj$"], "weights": _FP8_CHANNEL}}},
                   "Fp8", "Unquantized"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_FUSED_NAME_CASES))
def test_lists_naming_the_fused_module_apply_to_it(case: str) -> None:
    """A Phi-3 checkpoint's modules are ``qkv_proj`` / ``gate_up_proj``: skip lists and targets name
    those (was: ignored, so a plain ``qkv_proj`` was read as quantized or the reverse)."""
    from lorastar.models.llama import LlamaForCausalLM

    qc_dict, fused, other = _FUSED_NAME_CASES[case]
    qc = get_quant_config({"quantization_config": qc_dict}, None, torch.float32)
    qc.packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    assert type(qc.get_linear_method("model.layers.0.self_attn.qkv_proj")).__name__ == f"{fused}LinearMethod"
    assert type(qc.get_linear_method("model.layers.0.mlp.down_proj")).__name__ == f"{other}LinearMethod"


def test_gptq_marlin_flag_is_refused_naming_it() -> None:
    """auto-gptq's older Marlin checkpoints say ``is_marlin_format: true`` (tensors ``B`` / ``s``, not
    ``qweight``): refused at config time (was: accepted, then an unrelated tensor error)."""
    cfg = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "is_marlin_format": True}
    with pytest.raises(ValueError, match="marlin"):
        get_quant_config({"quantization_config": cfg}, None, torch.float16)


def test_gptq_dynamic_negative_pattern_leaves_modules_unquantized(tmp_path: Path) -> None:
    """gptqmodel's ``dynamic`` ``-:pattern`` keeps matching modules unquantized (was: refused)."""
    _need("gptq_sym")
    plain = [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    cfg = _rewrite(
        "gptq_sym", tmp_path, {"dynamic": {r"-:.*\.down_proj": {}}},
        lambda t: _gptq_dequantize_modules(t, plain),
    )  # fmt: skip
    model = _load_dir(tmp_path, cfg)
    assert type(model.linears()[plain[1]].quant_method).__name__ == "UnquantizedLinearMethod"
    err = _max_logit_error(model, "gptq_sym")
    assert err < INT4_TOL, f"logits differ by {err:.2e} relative"


def test_gptq_dynamic_positive_override_changes_the_layer_settings(tmp_path: Path) -> None:
    """``+:pattern`` -> settings: layer 1 is stored as gptq_asym stores it (group 64, asymmetric),
    layer 0 as gptq_sym (group 32); each layer must compute what its own fixture computes."""
    _need("gptq_sym")
    _need("gptq_asym")
    asym = read_config("gptq_asym")["quantization_config"]
    layer1 = {k: v for k, v in checkpoint("gptq_asym").items() if k.startswith("model.layers.1.")}
    override = {"group_size": asym["group_size"], "sym": asym["sym"]}
    cfg = _rewrite(
        "gptq_sym", tmp_path, {"dynamic": {r"+:model\.layers\.1\..*": override}}, lambda t: {**t, **layer1}
    )
    mixed = _load_dir(tmp_path, cfg).linears()
    own = {n: _load_dir(fixture_dir(n), read_config(n)).linears() for n in ("gptq_sym", "gptq_asym")}
    for prefix, lin in mixed.items():
        want = own["gptq_asym" if ".layers.1." in prefix else "gptq_sym"][prefix]
        assert lin.quant_method.config.group_size == want.quant_method.config.group_size
        torch.testing.assert_close(
            lin.quant_method.dequantized_weight(lin),
            want.quant_method.dequantized_weight(want),
            rtol=0,
            atol=0,
        )


@pytest.mark.parametrize(
    ("dynamic", "match"),
    [
        ({r"+:.*down_proj": {"bits": 3}}, "bits=3"),
        ({r"+:.*down_proj": {"adapter": {"rank": 8}}}, "adapter"),
        ({r"+:.*q_proj": {"bits": 8}}, "cannot fuse"),
    ],
)
def test_gptq_dynamic_unsupported_overrides_are_errors(dynamic: dict, match: str) -> None:
    from lorastar.models.llama import LlamaForCausalLM

    cfg = {"quant_method": "gptq", "bits": 4, "group_size": 32, "dynamic": dynamic}
    with pytest.raises(ValueError, match=match):
        qc = get_quant_config({"quantization_config": cfg}, None, torch.float32)
        qc.packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
        qc.get_linear_method("model.layers.0.self_attn.qkv_proj")
