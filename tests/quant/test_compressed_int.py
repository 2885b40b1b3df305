"""compressed-tensors int weight-only (pack-quantized W4A16 / W8A16): config detection, the names
``quantization=`` accepts, refusals naming the field, and the conversion to the GPTQ layout on
synthetic tensors (packing written here from the format's definition, independently of the loader).
Parity with transformers on the real fixtures: test_quant_e2e / test_quant_methods (CT_INT_NAMES)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from quant_fixtures import CT_INT_NAMES, present, read_config
from test_quant_methods import _make_linear

from lorastar.layers.linear import UnquantizedLinearMethod
from lorastar.quant import get_quant_config
from lorastar.quant.compressed_int import CompressedTensorsWNA16Config, CompressedTensorsWNA16LinearMethod
from lorastar.quant.fp8 import CompressedTensorsFp8Config


def _ct(weights: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    w = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True,
         "dynamic": False, "actorder": None, **(weights or {})}  # fmt: skip
    group = {"targets": ["Linear"], "weights": w, "input_activations": None, "format": "pack-quantized"}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
          "config_groups": {"group_0": group}, "sparsity_config": {}, "transform_config": {}, **top}  # fmt: skip
    return {"quantization_config": qc}


def _qc(cfg: dict[str, Any], requested: str | None = None):  # noqa: ANN202
    return get_quant_config(cfg, requested, torch.float32)


def _pack(u: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned values along ``dim``: element ``j`` of each word at bits ``[bits*j, bits*(j+1))``."""
    per = 32 // bits
    v = u.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, per) << (torch.arange(per) * bits)
    words = v.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).movedim(-1, dim)


def test_detection_and_requested_names() -> None:
    qc = _qc(_ct())
    assert isinstance(qc, CompressedTensorsWNA16Config) and qc.name == "compressed-tensors"
    assert isinstance(_qc(_ct(), "compressed-tensors"), CompressedTensorsWNA16Config)
    for wrong in ("fp8", "gptq"):
        with pytest.raises(ValueError, match="compressed-tensors"):
            _qc(_ct(), wrong)
    # FP8 compressed-tensors checkpoints keep their path, under either name.
    fp8 = _ct({"type": "float", "num_bits": 8, "strategy": "channel"}, format="float-quantized")
    for requested in (None, "fp8", "compressed-tensors"):
        assert isinstance(_qc(fp8, requested), CompressedTensorsFp8Config)
    with pytest.raises(ValueError, match="not quantized"):
        _qc({}, "compressed-tensors")


@pytest.mark.parametrize("name", present(CT_INT_NAMES))
def test_fixture_configs_are_detected(name: str) -> None:
    qc = _qc(read_config(name))
    assert isinstance(qc, CompressedTensorsWNA16Config)
    assert isinstance(
        qc.get_linear_method("model.layers.0.self_attn.qkv_proj"), CompressedTensorsWNA16LinearMethod
    )
    assert isinstance(qc.get_linear_method("lm_head"), UnquantizedLinearMethod)  # ignore: ["lm_head"]


@pytest.mark.parametrize(
    ("weights", "top", "match"),
    [
        ({"num_bits": 3}, {}, "num_bits"),
        ({"num_bits": 2}, {}, "num_bits"),
        ({"strategy": "tensor"}, {}, "strategy"),
        ({"strategy": "block", "block_structure": [128, 128]}, {}, "block_structure"),
        ({"dynamic": True}, {}, "dynamic"),
        ({"group_size": None}, {}, "group_size"),
        ({"actorder": "sideways"}, {}, "actorder"),
        ({}, {"format": "int-quantized"}, "format"),
        ({}, {"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config"),
        ({}, {"transform_config": {"config_groups": {"u": {}}}}, "transform_config"),
        ({}, {"kv_cache_scheme": {"num_bits": 8, "type": "int"}}, "kv_cache_scheme"),
    ],
)
def test_unsupported_settings_are_refused_naming_the_field(
    weights: dict[str, Any], top: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        _qc(_ct(weights, **top))


def test_activation_quantization_and_mixed_schemes_are_refused() -> None:
    cfg = _ct()
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
    with pytest.raises(ValueError, match="input_activations"):
        _qc(cfg)
    cfg = _ct()
    groups = cfg["quantization_config"]["config_groups"]
    groups["group_1"] = copy.deepcopy(groups["group_0"])
    groups["group_1"]["weights"].update(type="float", num_bits=8, strategy="channel")
    with pytest.raises(ValueError, match="mixed int and float"):
        _qc(cfg)


def test_targets_and_ignore_leave_layers_unquantized() -> None:
    cfg = _ct(ignore=["lm_head", "re:.*down_proj"])
    cfg["quantization_config"]["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*", "re:.*mlp.*"]
    qc = _qc(cfg)
    qc.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert isinstance(
        qc.get_linear_method("model.layers.0.self_attn.qkv_proj"), CompressedTensorsWNA16LinearMethod
    )
    assert isinstance(qc.get_linear_method("model.layers.0.mlp.down_proj"), UnquantizedLinearMethod)


@pytest.mark.parametrize(
    ("bits", "strategy", "sym", "actorder", "whole"),
    [(4, "group", True, None, False), (4, "group", False, None, False), (8, "channel", True, None, False),
     (8, "channel", False, None, False), (4, "group", True, "group", False), (4, "group", False, None, True)],
)  # fmt: skip
def test_fused_layer_matches_the_format_definition(
    bits: int, strategy: str, sym: bool, actorder: str | None, whole: bool
) -> None:
    """Per shard (q/k/v files), or ``whole``: one fused qkv_proj tensor set (Phi-3 style)."""
    gen = torch.Generator().manual_seed(bits + 2 * sym)
    k, sizes, gs = 128, [64, 32, 32], 32
    qc = _qc(_ct({"num_bits": bits, "strategy": strategy, "symmetric": sym, "actorder": actorder}))
    qc.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    lin = _make_linear(qc, "model.layers.0.self_attn.qkv_proj", k, sizes)
    m = lin.quant_method
    assert isinstance(m, CompressedTensorsWNA16LinearMethod)
    groups = k // gs if strategy == "group" else 1
    half = 1 << (bits - 1)
    g_idx = torch.randperm(k, generator=gen) // gs if actorder else torch.arange(k) * groups // k
    ws, shards = [], []
    for n in sizes:
        q = torch.randint(-half, half, (n, k), generator=gen)  # signed values
        z = torch.randint(-half, half, (n, groups), generator=gen) if not sym else torch.zeros(n, groups)
        s = (torch.rand(n, groups, generator=gen) * 0.01 + 1e-3).half()
        ws.append((q - z[:, g_idx]).float() * s.float()[:, g_idx])  # [n, k]
        t = {
            "weight_packed": _pack(q + half, bits, 1),
            "weight_scale": s,
            "weight_shape": torch.tensor([n, k]),
        }
        if not sym:
            t["weight_zero_point"] = _pack(z.long() + half, bits, 0)
        if actorder:
            t["weight_g_idx"] = g_idx.int()
        assert set(t) == set(m.expected_tensors())
        shards.append(t)
    if whole:
        fused = {n: torch.cat([t[n] for t in shards]) for n in ("weight_packed", "weight_scale")}
        fused["weight_shape"] = torch.tensor([sum(sizes), k])
        if not sym:
            fused["weight_zero_point"] = torch.cat([t["weight_zero_point"] for t in shards])
        shards = [fused]
    for i, t in enumerate(shards):
        for name, v in t.items():
            m.load_weight(lin, name, v, None if whole else i, f"shard{i}.{name}")
    m.process_weights_after_loading(lin)
    w = torch.cat(ws)
    torch.testing.assert_close(m.dequantized_weight(lin), w, rtol=0, atol=0)
    x = torch.randn(3, k, generator=gen)
    torch.testing.assert_close(lin(x), x @ w.t(), atol=1e-5, rtol=1e-5)


def test_bad_tensors_name_the_checkpoint_tensor() -> None:
    qc = _qc(_ct())
    lin = _make_linear(qc, "model.layers.0.mlp.down_proj", 64, [32])
    m = lin.quant_method
    src = "model.layers.0.mlp.down_proj.weight_shape"
    with pytest.raises(ValueError, match=r"down_proj\.weight_shape.*\[32, 64\]"):
        m.load_weight(lin, "weight_shape", torch.tensor([32, 128]), None, src)
    with pytest.raises(ValueError, match=r"weight_packed must be a 2-D int32"):
        m.load_weight(lin, "weight_packed", torch.zeros(32, 8, dtype=torch.int64), None, "x.weight_packed")
    zp = "x.weight_zero_point"
    m.load_weight(lin, "weight_zero_point", torch.zeros(32, 2, dtype=torch.int8), None, zp)  # old writers
    with pytest.raises(ValueError, match="symmetric scheme must have zero"):
        m.load_weight(lin, "weight_zero_point", torch.ones(32, 2, dtype=torch.int8), None, zp)
    with pytest.raises(ValueError, match="does not match"):
        m.load_weight(lin, "weight_scale", torch.ones(32, 3), None, "x.weight_scale")


def test_the_engine_and_serve_take_vllms_name_for_it() -> None:
    """``quantization="compressed-tensors"`` (vLLM's ``-q compressed-tensors``) checks the checkpoint
    through ``LLM`` / ``EngineConfig`` and ``lorastar serve -q`` as through ``get_quant_config``."""
    from click.testing import CliRunner
    from quant_fixtures import fixture_dir

    from lorastar import LLM, SamplingParams
    from lorastar.plugin.cli import main

    names = present(("w4a16_asym",))
    if not names:
        pytest.skip("fixture missing")
    model = str(fixture_dir(names[0]))
    llm = LLM(model=model, device="cpu", dtype="float32", num_kv_blocks=16, quantization="compressed-tensors")
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="compressed-tensors"):
        LLM(model=model, device="cpu", dtype="float32", num_kv_blocks=16, quantization="gptq")
    r = CliRunner().invoke(main, ["serve", "--port", "0", "-q", "compressed-tensors", "--max-lora-rank", "0"])
    assert "Invalid value for '--quantization'" not in r.output and "max_lora_rank" in r.output, r.output
