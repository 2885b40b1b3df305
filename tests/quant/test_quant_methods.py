"""QuantMethods on single (fused) Linears: synthetic shards vs the references, the real fixtures'
tensors vs transformers' own output of the same layer, config detection and broken checkpoints."""

from __future__ import annotations

import pytest
import torch
from quant_fixtures import CT_INT_NAMES, INT4_NAMES, checkpoint, present, read_config, reference

from lorastar.kernels import reference as R
from lorastar.layers.linear import Linear
from lorastar.models.llama import LlamaForCausalLM
from lorastar.quant import get_quant_config
from lorastar.quant.awq import AWQLinearMethod
from lorastar.quant.gptq import GPTQLinearMethod
from lorastar.quant.utils import unfused_prefixes

QKV = "model.layers.0.self_attn.qkv_proj"


def _rand_i32(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=gen)


def _make_linear(qc, prefix: str, k: int, sizes: list[int], bias: bool = False) -> Linear:  # noqa: ANN001
    names = [p.rsplit(".", 1)[1] for p in unfused_prefixes(prefix, LlamaForCausalLM.packed_modules_mapping)]
    return Linear(
        k, sizes, bias=bias, prefix=prefix, slice_names=names, params_dtype=torch.float32,
        quant_method=qc.get_linear_method(prefix),
    )  # fmt: skip


def _awq_qc(group_size: int = 32):  # noqa: ANN202
    cfg = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    return get_quant_config({"quantization_config": cfg}, None, torch.float32)


def _gptq_qc(bits: int = 4, group_size: int = 32, desc_act: bool = False, fmt: str = "gptq"):  # noqa: ANN202
    cfg = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": True,
           "checkpoint_format": fmt}  # fmt: skip
    return get_quant_config({"quantization_config": cfg}, None, torch.float32)


# ---------------------------------------------------------------------------------------------
# Synthetic fused layers vs references
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_fused_layer_matches_reference(group_size: int) -> None:
    gen = torch.Generator().manual_seed(group_size)
    k, sizes = 128, [64, 32, 32]
    lin = _make_linear(_awq_qc(group_size), QKV, k, sizes, bias=True)
    assert isinstance(lin.quant_method, AWQLinearMethod)
    shards = []
    for i, n in enumerate(sizes):
        t = {"qweight": _rand_i32(k, n // 8, gen=gen), "qzeros": _rand_i32(k // group_size, n // 8, gen=gen),
             "scales": (torch.rand(k // group_size, n, generator=gen) * 0.01).half()}  # fmt: skip
        shards.append(t)
        for name, v in t.items():
            lin.quant_method.load_weight(lin, name, v, i, f"shard{i}.{name}")
    lin.bias.data.normal_(generator=gen)
    lin.quant_method.process_weights_after_loading(lin)
    x = torch.randn(5, k, generator=gen)
    ref = torch.cat(
        [R.ref_awq_gemm(x, t["qweight"], t["qzeros"], t["scales"], group_size) for t in shards], 1
    )
    torch.testing.assert_close(lin(x), ref + lin.bias, atol=1e-5, rtol=1e-5)
    w = torch.cat([R.ref_awq_dequant(t["qweight"], t["qzeros"], t["scales"], group_size) for t in shards], 1)
    torch.testing.assert_close(lin.quant_method.dequantized_weight(lin), w.t())
    # Only packed tensors are kept: no float copy of the weight on the layer.
    floats = [
        n for n, p in lin.named_parameters() if p.dtype.is_floating_point and p.numel() >= k * sum(sizes) / 8
    ]
    assert floats == [], floats


@pytest.mark.parametrize(
    ("bits", "group_size", "desc_act", "fmt"),
    [
        (4, 32, False, "gptq"),
        (4, 64, True, "gptq"),
        (4, -1, False, "gptq_v2"),
        (8, 32, True, "gptq"),
        (8, -1, False, "gptq"),
    ],
)
def test_gptq_fused_layer_matches_reference(bits: int, group_size: int, desc_act: bool, fmt: str) -> None:
    gen = torch.Generator().manual_seed(bits + group_size)
    k, sizes = 128, [64, 64]
    prefix = "model.layers.1.mlp.gate_up_proj"
    lin = _make_linear(_gptq_qc(bits, group_size, desc_act, fmt), prefix, k, sizes)
    assert isinstance(lin.quant_method, GPTQLinearMethod)
    gs = k if group_size == -1 else group_size
    g_idx = (torch.randperm(k, generator=gen) // gs if desc_act else torch.arange(k) // gs).to(torch.int32)
    shards = []
    for i, n in enumerate(sizes):
        t = {"qweight": _rand_i32(k * bits // 32, n, gen=gen), "qzeros": _rand_i32(k // gs, n * bits // 32, gen=gen),
             "scales": (torch.rand(k // gs, n, generator=gen) * 0.01).half(), "g_idx": g_idx}  # fmt: skip
        shards.append(t)
        for name, v in t.items():
            lin.quant_method.load_weight(lin, name, v, i, f"shard{i}.{name}")
    lin.quant_method.process_weights_after_loading(lin)
    assert lin.quant_method.trivial_gidx == (not desc_act or gs == k)
    off = 0 if fmt == "gptq_v2" else 1
    x = torch.randn(3, k, generator=gen)
    ref = torch.cat(
        [R.ref_gptq_gemm(x, t["qweight"], t["qzeros"], t["scales"], g_idx, bits, off) for t in shards], 1
    )
    torch.testing.assert_close(lin(x), ref, atol=1e-4, rtol=1e-5)


def test_gptq_act_order_shards_must_share_g_idx() -> None:
    k = 64
    lin = _make_linear(_gptq_qc(4, 32, True), QKV, k, [32, 32, 32])
    a = (torch.randperm(k) // 32).int()
    lin.quant_method.load_weight(lin, "g_idx", a, 0, "model.layers.0.self_attn.q_proj.g_idx")
    with pytest.raises(ValueError, match=r"k_proj\.g_idx"):
        lin.quant_method.load_weight(lin, "g_idx", 1 - a, 1, "model.layers.0.self_attn.k_proj.g_idx")


# ---------------------------------------------------------------------------------------------
# Real fixtures: one layer vs transformers' output of the same layer (recorded by the script)
# ---------------------------------------------------------------------------------------------


def _load_fixture_linear(name: str, hf_prefix: str) -> Linear:
    """Build our (fused) Linear for the checkpoint module ``hf_prefix`` and load every shard."""
    cfg = read_config(name)
    qc = get_quant_config(cfg, None, torch.float32)
    block, proj = hf_prefix.rsplit(".", 1)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    fused = {
        "q_proj": ("qkv_proj", ["q_proj", "k_proj", "v_proj"], h, [q, kv, kv]),
        "k_proj": ("qkv_proj", ["q_proj", "k_proj", "v_proj"], h, [q, kv, kv]),
        "v_proj": ("qkv_proj", ["q_proj", "k_proj", "v_proj"], h, [q, kv, kv]),
        "o_proj": ("o_proj", ["o_proj"], q, [h]),
        "gate_proj": ("gate_up_proj", ["gate_proj", "up_proj"], h, [inter, inter]),
        "up_proj": ("gate_up_proj", ["gate_proj", "up_proj"], h, [inter, inter]),
        "down_proj": ("down_proj", ["down_proj"], inter, [h]),
    }
    fname, parts, k, sizes = fused[proj]
    lin = _make_linear(qc, f"{block}.{fname}", k, sizes)
    tensors = checkpoint(name, block + ".")
    for i, part in enumerate(parts):
        shard = i if len(parts) > 1 else None
        for suffix in lin.quant_method.expected_tensors():
            key = f"{block}.{part}.{suffix}"
            if key not in tensors:
                raise AssertionError(f"fixture lacks {key}")
            lin.quant_method.load_weight(lin, suffix, tensors[key], shard, key)
    lin.quant_method.process_weights_after_loading(lin)
    return lin


def _slice_of(lin: Linear, hf_prefix: str) -> slice:
    proj = hf_prefix.rsplit(".", 1)[1]
    names = lin.slice_names
    offs = lin.slice_offsets()
    i = names.index(proj) if proj in names else 0
    return slice(offs[i], offs[i + 1])


@pytest.mark.parametrize("name", present(INT4_NAMES + CT_INT_NAMES))
def test_int4_fixture_layers_match_transformers(name: str) -> None:
    ref = reference(name)
    probes = sorted({k.rsplit(".", 1)[0].removeprefix("probe.") for k in ref if k.startswith("probe.")})
    assert probes, "fixture has no per-layer probes"
    for p in probes:
        lin = _load_fixture_linear(name, p)
        x, y = ref[f"probe.{p}.x"], ref[f"probe.{p}.y"]
        out = lin(x)[:, _slice_of(lin, p)]
        err = ((out - y).abs().max() / y.abs().max()).item()
        assert err < 1e-4, f"{name} {p}: max error {err:.2e} relative to max |y|"


def test_fixture_checkpoint_detected_from_config_not_file_names() -> None:
    names = present(INT4_NAMES)
    if not names:
        pytest.skip("no int4 fixtures committed")
    for name in names:
        qc = get_quant_config(read_config(name), None, torch.float32)
        assert qc is not None and qc.name == name.split("_")[0]


# ---------------------------------------------------------------------------------------------
# get_quant_config: detection, forcing, mismatches, unsupported settings
# ---------------------------------------------------------------------------------------------


def test_plain_checkpoint() -> None:
    assert get_quant_config({"hidden_size": 8}, None, torch.float32) is None
    assert get_quant_config({}, "fp8", torch.bfloat16).name == "fp8"
    with pytest.raises(ValueError, match="awq.*not quantized"):
        get_quant_config({}, "awq", torch.float16)


@pytest.mark.parametrize(
    ("qc", "requested", "match"),
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 32}, "gptq", r"'gptq'.*'awq'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 32}, "fp8", r"'fp8'.*'gptq'"),
        ({"quant_method": "compressed-tensors", "config_groups": {}}, "awq", r"'awq'.*compressed-tensors"),
        ({"quant_method": "bitsandbytes"}, None, "bitsandbytes"),
        ({"quant_method": "awq", "bits": 3, "group_size": 32}, None, "bits=3"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, None, "gemv"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 32}, None, "bits=3"),
        ({"quant_method": "gptq", "bits": 2, "group_size": 32}, None, "bits=2"),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"},
            None,
            "marlin",
        ),
        ({"quant_method": "gptq", "bits": 4, "group_size": 32, "lm_head": True}, None, "lm_head"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, None, "block"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}
                },
            },
            None,
            "pack-quantized",
        ),  # fmt: skip
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "float", "strategy": "group"},
                    }
                },
            },
            None,
            "strategy 'group'",
        ),  # fmt: skip
    ],
)
def test_config_errors(qc: dict, requested: str | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_quant_config({"quantization_config": qc}, requested, torch.float16)


def test_requested_method_matching_checkpoint_is_accepted() -> None:
    qc = {"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False}
    assert get_quant_config({"quantization_config": qc}, "gptq", torch.float16).name == "gptq"


def test_modules_to_not_convert_stay_unquantized() -> None:
    cfg = {"quant_method": "awq", "bits": 4, "group_size": 32, "modules_to_not_convert": ["mlp"]}
    qc = get_quant_config({"quantization_config": cfg}, None, torch.float16)
    assert type(qc.get_linear_method("model.layers.0.mlp.gate_up_proj")).__name__ == "UnquantizedLinearMethod"
    assert isinstance(qc.get_linear_method(QKV), AWQLinearMethod)


def test_skip_list_naming_the_packed_parts_skips_the_fused_layer() -> None:
    """The model's packed_modules_mapping (set on the config by the model) maps q/k/v to qkv_proj."""
    parts = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    for skip, unquantized in ((parts, True), (["model.layers.1.self_attn.q_proj"], False)):
        cfg = {"quant_method": "awq", "bits": 4, "group_size": 32, "modules_to_not_convert": skip}
        qc = get_quant_config({"quantization_config": cfg}, None, torch.float16)
        qc.packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
        assert (type(qc.get_linear_method(QKV)).__name__ == "UnquantizedLinearMethod") == unquantized
    cfg = {"quant_method": "awq", "bits": 4, "group_size": 32, "modules_to_not_convert": parts[:1]}
    qc = get_quant_config({"quantization_config": cfg}, None, torch.float16)
    qc.packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    with pytest.raises(ValueError, match="quantizes only some"):
        qc.get_linear_method(QKV)


# ---------------------------------------------------------------------------------------------
# Broken tensors: errors name the checkpoint tensor
# ---------------------------------------------------------------------------------------------


def test_wrong_shape_names_the_tensor() -> None:
    lin = _make_linear(_awq_qc(32), QKV, 128, [64, 32, 32])
    bad = torch.zeros(128, 7, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.qweight.*\(128, 7\)"):
        lin.quant_method.load_weight(lin, "qweight", bad, 1, "model.layers.0.self_attn.k_proj.qweight")
    with pytest.raises(ValueError, match=r"v_proj\.scales"):
        lin.quant_method.load_weight(
            lin, "scales", torch.zeros(3, 32), 2, "model.layers.0.self_attn.v_proj.scales"
        )


def test_wrong_dtype_names_the_tensor() -> None:
    lin = _make_linear(_gptq_qc(4, 32), "model.layers.0.mlp.down_proj", 64, [64])
    with pytest.raises(ValueError, match=r"down_proj\.qweight.*int32"):
        lin.quant_method.load_weight(
            lin, "qweight", torch.zeros(8, 64), None, "model.layers.0.mlp.down_proj.qweight"
        )


def test_layer_shape_not_packable() -> None:
    with pytest.raises(ValueError, match="group_size"):
        _make_linear(_awq_qc(64), "model.layers.0.mlp.down_proj", 96, [64])
    with pytest.raises(ValueError, match="multiple of 8"):
        _make_linear(_awq_qc(32), "model.layers.0.mlp.down_proj", 64, [60])
