"""FP8 weights (compressed-tensors configs, on-the-fly), the FP8 linear paths, FP8 KV cache helpers."""

from __future__ import annotations

import pytest
import torch
from quant_fixtures import FP8_NAMES, present, read_config, reference

from lorastar.kernels import reference as R
from lorastar.kernels.fp8 import ACT_TENSOR_STATIC, ACT_TOKEN, fp8_linear, quantize_weight_per_channel
from lorastar.layers.linear import Linear
from lorastar.quant import get_quant_config
from lorastar.quant.fp8 import CompressedTensorsFp8Config, Fp8LinearMethod
from lorastar.quant.kv_cache import KVScales, compute_kv_scale, kv_cache_torch_dtype, parse_kv_scale_key

QKV = "model.layers.0.self_attn.qkv_proj"


def _ct_config(weight_strategy: str, act: dict | None, kv: dict | None = None) -> dict:
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": weight_strategy,
                                                "symmetric": True, "dynamic": False}}  # fmt: skip
    if act is not None:
        group["input_activations"] = act
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                    "config_groups": {"group_0": group}, "ignore": ["lm_head"],
                                    "kv_cache_scheme": kv}}  # fmt: skip


TOKEN_DYN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
TENSOR_STATIC = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def _linear(qc, prefix: str, k: int, sizes: list[int]) -> Linear:  # noqa: ANN001
    names = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    last = prefix.rsplit(".", 1)[1]
    return Linear(
        k, sizes, bias=False, prefix=prefix, slice_names=names.get(last, [last]), params_dtype=torch.float32,
        quant_method=qc.get_linear_method(prefix),
    )  # fmt: skip


def test_detects_compressed_tensors_schemes() -> None:
    qc = get_quant_config(_ct_config("channel", TOKEN_DYN), None, torch.bfloat16)
    assert isinstance(qc, CompressedTensorsFp8Config) and qc.name == "fp8"
    m = qc.get_linear_method(QKV)
    assert isinstance(m, Fp8LinearMethod) and (m.weight_strategy, m.act) == ("channel", ACT_TOKEN)
    qc = get_quant_config(_ct_config("tensor", TENSOR_STATIC), "fp8", torch.bfloat16)
    m = qc.get_linear_method("model.layers.3.mlp.down_proj")
    assert (m.weight_strategy, m.act, m.expected_tensors()) == ("tensor", ACT_TENSOR_STATIC,
                                                                ("weight", "weight_scale", "input_scale"))  # fmt: skip
    with pytest.raises(ValueError, match=r"'gptq'.*compressed-tensors"):
        get_quant_config(_ct_config("channel", TOKEN_DYN), "gptq", torch.bfloat16)
    with pytest.raises(ValueError, match="strategy 'group'"):
        get_quant_config(_ct_config("channel", {**TOKEN_DYN, "strategy": "group"}), None, torch.bfloat16)


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
@pytest.mark.parametrize("act", [TOKEN_DYN, TENSOR_STATIC, None])
def test_fp8_fused_layer_matches_reference(strategy: str, act: dict | None) -> None:
    qc = get_quant_config(_ct_config(strategy, act), None, torch.float32)
    k, sizes = 64, [32, 16, 16]
    lin = _linear(qc, QKV, k, sizes)
    g = torch.Generator().manual_seed(0)
    shards = []
    for i, n in enumerate(sizes):
        w = torch.randn(n, k, generator=g)
        if strategy == "channel":
            s = w.abs().amax(1, keepdim=True) / 448  # [n, 1]
        else:
            s = (w.abs().amax() / 448).reshape(1)
        wq = (w / s).to(torch.float8_e4m3fn)
        xs = torch.tensor([0.01 * (i + 1)])  # different static input scales per shard
        shards.append((wq, s, xs))
        lin.quant_method.load_weight(lin, "weight", wq, i, f"s{i}.weight")
        lin.quant_method.load_weight(lin, "weight_scale", s, i, f"s{i}.weight_scale")
        if act is TENSOR_STATIC:
            lin.quant_method.load_weight(lin, "input_scale", xs, i, f"s{i}.input_scale")
    lin.quant_method.process_weights_after_loading(lin)
    x = torch.randn(5, k, generator=g)
    ref = torch.cat(
        [R.ref_fp8_linear(x, wq, s, xs if act is TENSOR_STATIC else None, quantize_input=act is not None)
         for wq, s, xs in shards], dim=1,
    )  # fmt: skip
    torch.testing.assert_close(lin(x), ref, atol=1e-5, rtol=1e-5)


def test_fp8_per_tensor_scale_wrong_shape_names_tensor() -> None:
    qc = get_quant_config(_ct_config("tensor", TOKEN_DYN), None, torch.float32)
    lin = _linear(qc, QKV, 64, [32, 16, 16])
    with pytest.raises(ValueError, match=r"k_proj\.weight_scale.*per-tensor"):
        lin.quant_method.load_weight(
            lin, "weight_scale", torch.ones(16, 1), 1, "model.layers.0.self_attn.k_proj.weight_scale"
        )
    with pytest.raises(ValueError, match=r"q_proj\.weight.*float8_e4m3fn"):
        lin.quant_method.load_weight(
            lin, "weight", torch.ones(32, 64), 0, "model.layers.0.self_attn.q_proj.weight"
        )


def test_on_the_fly_fp8_keeps_only_fp8_weights() -> None:
    qc = get_quant_config({}, "fp8", torch.bfloat16)
    k, sizes = 64, [32, 32]
    lin = _linear(qc, "model.layers.0.mlp.gate_up_proj", k, sizes)
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(n, k, generator=g).to(torch.bfloat16) for n in sizes]
    for i, w in enumerate(ws):
        lin.quant_method.load_weight(lin, "weight", w, i, f"gate_up.{i}")
    lin.quant_method.process_weights_after_loading(lin)
    assert lin.weight.dtype == torch.float8_e4m3fn
    assert not any(
        p.dtype.is_floating_point and p.element_size() > 1 and p.numel() >= k for p in [lin.weight]
    )
    x = torch.randn(3, k, generator=g)
    wq, s = quantize_weight_per_channel(torch.cat(ws))
    torch.testing.assert_close(lin(x), R.ref_fp8_linear(x, wq, s.view(-1, 1)), atol=1e-5, rtol=1e-5)
    w_full = torch.cat(ws).float()
    rel = ((lin.quant_method.dequantized_weight(lin) - w_full).norm() / w_full.norm()).item()
    assert rel < 0.05  # e4m3: ~3 mantissa bits


@pytest.mark.gpu
def test_scaled_mm_matches_upcast_path() -> None:
    from lorastar.kernels.fp8 import scaled_mm_supported

    dev = torch.device("cuda")
    if not scaled_mm_supported(dev):
        pytest.skip("GPU without FP8 matmul")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 128, generator=g).to(dev, torch.bfloat16)
    wq, s = quantize_weight_per_channel(torch.randn(64, 128, generator=g))
    wq, s = wq.to(dev), s.to(dev)
    for act, xs in ((ACT_TOKEN, None), (ACT_TENSOR_STATIC, torch.tensor([0.02], device=dev))):
        fast = fp8_linear(x, wq, s, act=act, input_scale=xs, use_scaled_mm=True).float()
        slow = fp8_linear(x.float(), wq, s, act=act, input_scale=xs, use_scaled_mm=False)
        torch.testing.assert_close(fast, slow, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("name", present(FP8_NAMES))
def test_fp8_fixture_layers_match_transformers(name: str) -> None:
    from test_quant_methods import _load_fixture_linear, _slice_of

    ref = reference(name)
    assert get_quant_config(read_config(name), None, torch.float32).name == "fp8"
    probes = sorted({k.rsplit(".", 1)[0].removeprefix("probe.") for k in ref if k.startswith("probe.")})
    for p in probes:
        lin = _load_fixture_linear(name, p)
        x, y = ref[f"probe.{p}.x"], ref[f"probe.{p}.y"]
        out = lin(x)[:, _slice_of(lin, p)]
        err = ((out - y).abs().max() / y.abs().max()).item()
        assert err < 1e-5, f"{name} {p}: max error {err:.2e} relative to max |y|"


# ---------------------------------------------------------------------------------------------
# FP8 KV cache
# ---------------------------------------------------------------------------------------------


def test_kv_cache_dtypes() -> None:
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float16) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.float16) == torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_torch_dtype("int8", torch.float16)
    # Same memory, twice the blocks: one fp8 element is half a 16-bit one.
    assert torch.empty((), dtype=kv_cache_torch_dtype("fp8", torch.bfloat16)).element_size() * 2 == 2


def test_kv_scales_from_checkpoint_and_defaults() -> None:
    assert parse_kv_scale_key("model.layers.3.self_attn.k_scale") == (3, "k")
    assert parse_kv_scale_key("model.layers.0.self_attn.v_proj.output_scale") == (0, "v")
    assert parse_kv_scale_key("model.layers.2.self_attn.attn.v_scale") == (
        2,
        "v",
    )  # the loader's spelling too
    assert parse_kv_scale_key("model.layers.0.self_attn.v_proj.weight_scale") is None
    sc = KVScales(num_layers=2)
    assert sc.resolve("fp8") == ([1.0, 1.0], [1.0, 1.0])  # nothing in the checkpoint: 1.0
    for i in range(2):
        assert sc.add(f"model.layers.{i}.self_attn.k_scale", torch.tensor([0.5 + i]))
        assert sc.add(f"model.layers.{i}.self_attn.v_scale", torch.tensor(0.25))
    assert sc.resolve("fp8") == ([0.5, 1.5], [0.25, 0.25])
    assert sc.resolve("auto") == ([1.0, 1.0], [1.0, 1.0])  # unquantized cache ignores them
    partial = KVScales(num_layers=2)
    partial.add("model.layers.0.self_attn.k_scale", torch.tensor(0.5))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_scale"):
        partial.resolve("fp8")
    with pytest.raises(ValueError, match="positive"):
        KVScales(1).add("model.layers.0.self_attn.v_scale", torch.tensor(0.0))
    assert compute_kv_scale(torch.tensor([-896.0, 3.0]), "fp8") == pytest.approx(2.0)


@pytest.mark.parametrize("name", present(("gptq_sym",)))
def test_fp8_kv_cache_doubles_blocks_and_keeps_greedy_tokens(name: str) -> None:
    """At equal KV memory the fp8 cache holds 1/element-size as many more blocks (twice a 16-bit
    cache's); greedy tokens follow the unquantized cache until a near tie (the tiny model has some; the SmolLM2 figure is in benchmarks/quant.py)."""
    pytest.importorskip("lorastar.models.loader", reason="engine loader not available")
    from quant_fixtures import fixture_dir

    from lorastar import LLM, SamplingParams

    ref = reference(name)
    prompts = [
        ref["input_ids"][i, : int(ref["prompt_len"][i])].tolist() for i in range(ref["input_ids"].shape[0])
    ]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    runs = {}
    for kv in ("auto", "fp8", "fp8_e5m2"):
        llm = LLM(model=str(fixture_dir(name)), device="cpu", dtype="float32", kv_cache_dtype=kv,
                  kv_cache_memory=1 << 20, enable_prefix_caching=False)  # fmt: skip
        runs[kv] = (llm.kv_cache_usage()["num_blocks"], [o.outputs[0] for o in llm.generate(prompts, params)])
    for kv in ("fp8", "fp8_e5m2"):
        assert runs[kv][0] == 4 * runs["auto"][0]  # fp32 model here: 4 bytes -> 1 (2x vs a 16-bit cache)
        for base, got in zip(runs["auto"][1], runs[kv][1]):
            diverged = [i for i, (a, b) in enumerate(zip(base.token_ids, got.token_ids)) if a != b]
            if diverged:  # only at a near tie of the 16-bit run, after which the sequences differ
                top = sorted((lp.logprob for lp in base.logprobs[diverged[0]].values()), reverse=True)
                assert top[0] - top[1] < 0.25, f"{kv}: diverged at a clear choice ({top[0] - top[1]:.3f})"


@pytest.mark.parametrize("name", present(("fp8_kv",)))
def test_fp8_kv_scales_from_checkpoint_follow_transformers(name: str) -> None:
    """llm-compressor's kv_cache_scheme: per-layer ``self_attn.k_scale/v_scale`` in the checkpoint.
    With ``kv_cache_dtype="fp8"`` the engine uses them and reproduces the greedy continuation that
    transformers computes with K/V quantized (one prompt's continuation differs from the unquantized
    KV run, so this discriminates); with the 16-bit cache it follows the unquantized run."""
    pytest.importorskip("lorastar.models.loader", reason="engine loader not available")
    from quant_fixtures import checkpoint, fixture_dir

    from lorastar import LLM, SamplingParams

    ref = reference(name)
    ck = checkpoint(name)
    n_layers = read_config(name)["num_hidden_layers"]
    want_k = [float(ck[f"model.layers.{i}.self_attn.k_scale"]) for i in range(n_layers)]
    rows = range(ref["input_ids"].shape[0])
    prompts = [ref["input_ids"][i, : int(ref["prompt_len"][i])].tolist() for i in rows]
    wants = [ref["input_ids"][i, int(ref["prompt_len"][i]) : int(ref["seq_len"][i])].tolist() for i in rows]
    llm = LLM(model=str(fixture_dir(name)), device="cpu", dtype="float32", kv_cache_dtype="fp8",
              num_kv_blocks=64, enable_prefix_caching=False)  # fmt: skip
    assert llm.engine.runner.k_scales == pytest.approx(want_k)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=len(wants[0]), ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == wants
