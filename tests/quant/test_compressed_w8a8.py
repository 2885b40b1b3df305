"""compressed-tensors W8A8 (int8 weights per channel, int8 activations per token, dynamic:
``format: int-quantized``, llm-compressor's W8A8 preset; RedHatAI's "quantized.w8a8" layout) on
the CPU, against the real fixture ``w8a8`` (scripts/make_quant_fixtures.py): each probed linear
equals transformers + compressed-tensors' own forward (which quantizes activations with
amax / 127.5), the model's logits and greedy tokens too, LoRA on it equals PEFT on the decompressed
base with the same input quantization (test_lora_on_quant.py), and the schemes not served are refused naming the field."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from quant_fixtures import fixture_dir, present, read_config, reference
from test_quant_e2e import FP8_TOL, _compare
from test_quant_methods import _load_fixture_linear, _slice_of

from lorastar.kernels.int8 import CT_INT8_HALF_RANGE, int8_linear
from lorastar.kernels.reference import ref_int8_linear
from lorastar.quant import get_quant_config
from lorastar.quant.compressed_int import CompressedTensorsW8A8LinearMethod, CompressedTensorsWNA16Config

pytestmark = pytest.mark.skipif(not present(("w8a8",)), reason="w8a8 fixture missing")


def test_the_fixture_is_detected_as_w8a8_on_the_cpu() -> None:
    qc = get_quant_config(read_config("w8a8"), None, torch.float32)
    assert isinstance(qc, CompressedTensorsWNA16Config) and qc.devices == ("cpu",)
    assert isinstance(
        qc.get_linear_method("model.layers.0.self_attn.qkv_proj"), CompressedTensorsW8A8LinearMethod
    )
    assert qc.get_linear_method("lm_head").__class__.__name__ == "UnquantizedLinearMethod"  # ignored
    assert get_quant_config(read_config("w8a8"), "compressed-tensors", torch.float32).devices == ("cpu",)


def test_probed_layers_equal_compressed_tensors_forward() -> None:
    """Fused q/k/v and the MLP's down projection on transformers' probe inputs: equal to its output
    within fp32 rounding. vLLM's activation scale (amax / 127) would be off by about 1e-2."""
    ref = reference("w8a8")
    probes = sorted({k.rsplit(".", 1)[0].removeprefix("probe.") for k in ref if k.startswith("probe.")})
    assert len(probes) == 3
    for p in probes:
        lin = _load_fixture_linear("w8a8", p)
        assert isinstance(lin.quant_method, CompressedTensorsW8A8LinearMethod)
        x, y = ref[f"probe.{p}.x"], ref[f"probe.{p}.y"]
        out = lin(x)[:, _slice_of(lin, p)]
        err = ((out - y).abs().max() / y.abs().max()).item()
        assert err < 1e-5, f"{p}: max error {err:.2e} relative to max |y|"
        vllm_scale = int8_linear(x, lin.weight_t, lin.weight_scale)[:, _slice_of(lin, p)]
        assert ((vllm_scale - y).abs().max() / y.abs().max()).item() > 1e-3


def test_int8_linear_with_compressed_tensors_scale_equals_the_reference() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)
    x[2] = 0.0
    w = torch.randint(-128, 128, (24, 64), generator=g, dtype=torch.int8)
    s = torch.rand(24, generator=g) * 0.01
    got = int8_linear(x, w.t().contiguous(), s, None, CT_INT8_HALF_RANGE)
    want = ref_int8_linear(x, w, s, None, CT_INT8_HALF_RANGE)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_logits_and_greedy_tokens_equal_transformers() -> None:
    err, bad, checked = _compare("w8a8")
    print(
        f"w8a8 [cpu]: max logit error {err:.2e} (relative to max |logit|), greedy {checked - bad}/{checked}"
    )
    # Each layer is exact (the probes); through the model, a value on a rounding edge of the
    # per-token activation quantization may round the other way: the FP8 W8A8 schemes' tolerance.
    assert err < FP8_TOL and bad == 0 and checked > 0


def test_generate_reproduces_transformers_greedy() -> None:
    from lorastar import LLM, SamplingParams

    ref = reference("w8a8")
    llm = LLM(model=str(fixture_dir("w8a8")), device="cpu", dtype="float32", num_kv_blocks=64)
    for i in range(ref["input_ids"].shape[0]):
        n, p = int(ref["seq_len"][i]), int(ref["prompt_len"][i])
        ids = ref["input_ids"][i, :n].tolist()
        (o,) = llm.generate(
            [{"prompt_token_ids": ids[:p]}], SamplingParams(temperature=0, max_tokens=n - p, ignore_eos=True)
        )
        assert o.outputs[0].token_ids == ids[p:]


def _group(**changes: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(read_config("w8a8"))
    qc = cfg["quantization_config"]
    g = qc["config_groups"]["group_0"]
    for key, value in changes.items():
        if key == "format":
            g["format"] = qc["format"] = value
        elif key in ("weights", "input_activations"):
            g[key] = {**g[key], **value}
        else:
            g[key] = value
    return cfg


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (
            {"weights": {"num_bits": 4, "strategy": "group", "group_size": 32}},
            r"group_0\.input_activations: .*W4A8",
        ),
        ({"input_activations": {"dynamic": False}}, r"input_activations.*static activation scales"),
        ({"input_activations": {"strategy": "tensor"}}, r"input_activations.*strategy='tensor'"),
        ({"input_activations": {"symmetric": False}}, r"input_activations.*symmetric=False"),
        ({"weights": {"strategy": "tensor"}}, r"input_activations.*weights \{num_bits=8, strategy='tensor'"),
        ({"format": "pack-quantized"}, r"format 'pack-quantized' is not supported for W8A8"),
        ({"output_activations": {"num_bits": 8, "type": "int"}}, r"group_0\.output_activations"),
    ],
)
def test_schemes_not_served_are_refused_naming_the_field(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_quant_config(_group(**changes), None, torch.float32)


def test_bad_tensors_name_the_checkpoint_tensor() -> None:
    from lorastar.layers.linear import Linear

    lin = Linear(8, [4], bias=False, prefix="x", slice_names=["x"], params_dtype=torch.float32,
                 quant_method=CompressedTensorsW8A8LinearMethod())  # fmt: skip
    with pytest.raises(ValueError, match=r"x\.weight: a W8A8 weight must be int8"):
        lin.quant_method.load_weight(lin, "weight", torch.zeros(4, 8), None, "x.weight")
    with pytest.raises(ValueError, match=r"x\.weight_scale: weight_scale must be a per-channel"):
        lin.quant_method.load_weight(lin, "weight_scale", torch.ones(4, 2), None, "x.weight_scale")
    with pytest.raises(ValueError, match="zero"):
        lin.quant_method.load_weight(
            lin, "weight_zero_point", torch.ones(4, 1, dtype=torch.int8), None, "x.z"
        )
