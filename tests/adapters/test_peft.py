"""PEFT folder reading: the loaded A/B (scaling folded) must reproduce PEFT's own merge, and every
unsupported or broken adapter is refused with an AdapterError naming the file and the problem."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorastar.adapters.peft import MODULE_GROUP, ModelSpec, load_peft_adapter
from lorastar.errors import AdapterError
from lorastar.models.llama import LlamaForCausalLM

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_config() -> Any:
    return transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )


def make_peft(out: Path, seed: int = 0, **lora_kwargs: Any) -> Any:
    """Save a real PEFT adapter (nonzero A and B) on the tiny Llama; return the PeftModel."""
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(tiny_config())
    kwargs: dict[str, Any] = {"r": 8, "lora_alpha": 16, "target_modules": ALL, "task_type": "CAUSAL_LM"}
    kwargs.update(lora_kwargs)
    pm = peft.get_peft_model(base, peft.LoraConfig(**kwargs))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_A" in n or "lora_B" in n:
                p.normal_(0, 0.1)  # PEFT inits B to zero: make the adapter do something
    pm.save_pretrained(str(out), safe_serialization=True)
    return pm


def spec_of(config: dict[str, Any]) -> ModelSpec:
    """The spec the engine builds: read off the model's own linears."""
    from lorastar.models.llama import LlamaForCausalLM

    return ModelSpec.from_model(LlamaForCausalLM(config, torch.float32, None, 64))


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return spec_of(tiny_config().to_dict())


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    d = tmp_path_factory.mktemp("good") / "ad"
    return d, make_peft(d)


def peft_lora_pairs(pm: Any) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]:
    out = {}
    for name, mod in pm.named_modules():
        if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1])
            out[(layer, parts[-1])] = (
                mod.lora_A["default"].weight.detach(),
                mod.lora_B["default"].weight.detach(),
                float(mod.scaling["default"]),
            )
    return out


def check_against_peft(path: Path, pm: Any, spec: ModelSpec, **load_kw: Any) -> None:
    w = load_peft_adapter(path, spec, max_rank=load_kw.get("max_rank", 64))
    ref = peft_lora_pairs(pm)
    assert set(w.weights) == set(ref)
    for key, (a_ref, b_ref, scaling) in ref.items():
        a, b = w.weights[key]
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, a_ref)
        torch.testing.assert_close(b, b_ref * scaling)
    # (W + B@A) must equal PEFT's own merged weight.
    base_w = {}
    for layer, module in ref:
        grp = "self_attn" if module in ALL[:4] else "mlp"
        lin = getattr(getattr(pm.base_model.model.model.layers[layer], grp), module)
        base_w[(layer, module)] = lin.base_layer.weight.detach().clone()
    merged = pm.merge_and_unload()
    for (layer, module), w0 in base_w.items():
        grp = "self_attn" if module in ALL[:4] else "mlp"
        mw = getattr(getattr(merged.model.layers[layer], grp), module).weight.detach()
        a, b = w.weights[(layer, module)]
        torch.testing.assert_close(w0 + b @ a, mw, rtol=1e-5, atol=1e-5)


def test_loads_and_matches_peft_merge(spec: ModelSpec, tmp_path: Path) -> None:
    pm = make_peft(tmp_path / "ad", seed=1)
    w = load_peft_adapter(tmp_path / "ad", spec, max_rank=64)
    assert w.rank == 8 and w.alpha == 16.0 and not w.use_rslora
    assert w.target_modules == frozenset(ALL)
    assert len(w.weights) == 2 * len(ALL)
    assert w.nbytes() == sum(a.numel() * 4 + b.numel() * 4 for a, b in w.weights.values())
    assert w.path == str((tmp_path / "ad").resolve())
    check_against_peft(tmp_path / "ad", pm, spec)


def test_rslora_scaling(spec: ModelSpec, tmp_path: Path) -> None:
    pm = make_peft(
        tmp_path / "ad", seed=2, r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "down_proj"]
    )
    w = load_peft_adapter(tmp_path / "ad", spec, max_rank=64)
    assert w.use_rslora and w.rank == 4
    a_ref, b_ref, scaling = peft_lora_pairs(pm)[(0, "q_proj")]
    assert scaling == pytest.approx(8 / math.sqrt(4))
    check_against_peft(tmp_path / "ad", pm, spec)


def test_rank_and_alpha_pattern(spec: ModelSpec, tmp_path: Path) -> None:
    pm = make_peft(
        tmp_path / "ad",
        seed=3,
        r=4,
        lora_alpha=8,
        rank_pattern={"q_proj": 8, "model.layers.1.mlp.down_proj": 2},
        alpha_pattern={"down_proj": 32},
    )
    w = load_peft_adapter(tmp_path / "ad", spec, max_rank=8)
    assert w.weights[(0, "q_proj")][0].shape == (8, 64)
    assert w.weights[(1, "down_proj")][0].shape == (2, 128)
    assert w.weights[(0, "k_proj")][0].shape == (4, 64)
    assert w.rank == 8
    check_against_peft(tmp_path / "ad", pm, spec)


def test_regex_target_modules(spec: ModelSpec, tmp_path: Path) -> None:
    pm = make_peft(tmp_path / "ad", seed=4, target_modules=r".*layers\.1\.self_attn\.(q_proj|v_proj)")
    w = load_peft_adapter(tmp_path / "ad", spec, max_rank=64)
    assert w.target_modules == frozenset({"q_proj", "v_proj"})
    assert set(w.weights) == {(1, "q_proj"), (1, "v_proj")}
    check_against_peft(tmp_path / "ad", pm, spec)


def rewrite(
    src: Path,
    dst: Path,
    cfg: Callable[[dict[str, Any]], None] | None = None,
    tensors: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    shutil.copytree(src, dst)
    if cfg is not None:
        c = json.loads((dst / "adapter_config.json").read_text())
        cfg(c)
        (dst / "adapter_config.json").write_text(json.dumps(c))
    if tensors is not None:
        t = load_file(dst / "adapter_model.safetensors")
        tensors(t)
        save_file(t, dst / "adapter_model.safetensors")
    return dst


def test_hash_ignores_path_and_key_spelling(spec: ModelSpec, good: tuple[Path, Any], tmp_path: Path) -> None:
    src = good[0]
    h = load_peft_adapter(src, spec, max_rank=64).content_hash

    def strip_prefix(t: dict[str, torch.Tensor]) -> None:
        for k in list(t):
            t[k.removeprefix("base_model.model.")] = t.pop(k)

    def add_default(t: dict[str, torch.Tensor]) -> None:
        for k in list(t):
            t[k.replace(".weight", ".default.weight")] = t.pop(k)

    assert load_peft_adapter(rewrite(src, tmp_path / "copy"), spec, max_rank=64).content_hash == h
    w = load_peft_adapter(rewrite(src, tmp_path / "noprefix", tensors=strip_prefix), spec, max_rank=64)
    assert w.content_hash == h
    assert (
        load_peft_adapter(
            rewrite(src, tmp_path / "dflt", tensors=add_default), spec, max_rank=64
        ).content_hash
        == h
    )

    def bump(t: dict[str, torch.Tensor]) -> None:
        k = next(iter(t))
        t[k] = t[k] + 1e-3

    assert (
        load_peft_adapter(rewrite(src, tmp_path / "bumped", tensors=bump), spec, max_rank=64).content_hash
        != h
    )
    alpha2 = rewrite(src, tmp_path / "alpha", cfg=lambda c: c.update(lora_alpha=32))
    assert load_peft_adapter(alpha2, spec, max_rank=64).content_hash != h


def test_half_precision_storage_is_upcast(spec: ModelSpec, good: tuple[Path, Any], tmp_path: Path) -> None:
    def to_bf16(t: dict[str, torch.Tensor]) -> None:
        for k in t:
            t[k] = t[k].to(torch.bfloat16)

    w = load_peft_adapter(rewrite(good[0], tmp_path / "bf16", tensors=to_bf16), spec, max_rank=64)
    assert all(a.dtype == torch.float32 and b.dtype == torch.float32 for a, b in w.weights.values())


# ---- refusals -------------------------------------------------------------------------------------

_ONE_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _set(**kv: Any) -> Callable[[dict[str, Any]], None]:
    return lambda c: c.update(kv)


def _drop(key: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.pop(key)


def _put(key: str, value: torch.Tensor) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.__setitem__(key, value)


CASES: list[tuple[str, dict[str, Any], str, str]] = [
    # id, rewrite kwargs, file named in the message, expected message fragment
    ("peft_type_loha", {"cfg": _set(peft_type="LOHA")}, "adapter_config.json", "peft_type 'LOHA'"),
    ("peft_type_prefix", {"cfg": _set(peft_type="PREFIX_TUNING")}, "adapter_config.json", "only LORA"),
    ("peft_type_missing", {"cfg": lambda c: c.pop("peft_type")}, "adapter_config.json", "peft_type None"),
    ("modules_to_save", {"cfg": _set(modules_to_save=["lm_head"])}, "adapter_config.json", "modules_to_save"),
    (
        "unknown_target",
        {"cfg": _set(target_modules=["q_proj", "embed_tokens"])},
        "adapter_config.json",
        "embed_tokens",
    ),
    ("c_attn", {"cfg": _set(target_modules=["c_attn"])}, "adapter_config.json", "supported modules"),
    ("rank_zero", {"cfg": _set(r=0)}, "adapter_config.json", "rank must be >= 1"),
    ("dora", {"cfg": _set(use_dora=True)}, "adapter_config.json", "DoRA"),
    # Inits that rewrite the base too (PEFT repeats them at load): served on our base, wrong.
    ("pissa", {"cfg": _set(init_lora_weights="pissa")}, "adapter_config.json", "init_lora_weights='pissa'"),
    ("pissa_niter", {"cfg": _set(init_lora_weights="pissa_niter_4")}, "adapter_config.json", "PiSSA"),
    ("olora", {"cfg": _set(init_lora_weights="olora")}, "adapter_config.json", "OLoRA"),
    ("corda", {"cfg": _set(init_lora_weights="corda")}, "adapter_config.json", "CorDA"),
    ("loftq", {"cfg": _set(init_lora_weights="loftq")}, "adapter_config.json", "quantized base"),
    ("bias", {"cfg": _set(bias="all")}, "adapter_config.json", "bias='all'"),
    ("lora_bias", {"cfg": _set(lora_bias=True)}, "adapter_config.json", "lora_bias"),
    ("bad_alpha", {"cfg": _set(lora_alpha="x")}, "adapter_config.json", "lora_alpha"),
    ("bad_regex", {"cfg": _set(target_modules="(")}, "adapter_config.json", "regex"),
    (
        "target_mismatch",
        {"cfg": _set(target_modules=["v_proj"])},
        "adapter_config.json",
        "does not select",
    ),
    ("missing_A", {"tensors": _drop(_ONE_KEY)}, "adapter_model.safetensors", "lora_A is missing"),
    (
        "missing_B",
        {"tensors": _drop(_ONE_KEY.replace("lora_A", "lora_B"))},
        "adapter_model.safetensors",
        "lora_B is missing",
    ),
    (
        "shape",
        {"tensors": _put(_ONE_KEY, torch.zeros(8, 32))},
        "adapter_model.safetensors",
        "do not match the base",
    ),
    (
        "tensor_rank_vs_config",
        {"tensors": _put(_ONE_KEY, torch.zeros(4, 64))},
        "adapter_model.safetensors",
        "expected A [8, 64]",
    ),
    (
        "layer_range",
        {
            "tensors": lambda t: t.update(
                {k.replace("layers.1.", "layers.7."): t.pop(k) for k in list(t) if ".1." in k}
            )
        },
        "adapter_model.safetensors",
        "layer index 7 out of range",
    ),
    (
        "int_dtype",
        {"tensors": _put(_ONE_KEY, torch.zeros(8, 64, dtype=torch.int8))},
        "adapter_model.safetensors",
        "dtype",
    ),
    (
        "nan",
        {"tensors": _put(_ONE_KEY, torch.full((8, 64), float("nan")))},
        "adapter_model.safetensors",
        "non-finite",
    ),
    (
        "lm_head_tensor",
        {"tensors": _put("base_model.model.lm_head.lora_A.weight", torch.zeros(8, 64))},
        "adapter_model.safetensors",
        "unsupported target module 'lm_head'",
    ),
    (
        "embedding_tensor",
        {"tensors": _put("base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(8, 128))},
        "adapter_model.safetensors",
        "'embed_tokens'",
    ),
    (
        "saved_module",
        {"tensors": _put("base_model.model.lm_head.modules_to_save.default.weight", torch.zeros(128, 64))},
        "adapter_model.safetensors",
        "not a LoRA A/B weight",
    ),
    (
        "dora_magnitude",
        {
            "tensors": _put(
                "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", torch.ones(64)
            )
        },
        "adapter_model.safetensors",
        "DoRA",
    ),
    ("empty", {"tensors": lambda t: t.clear()}, "adapter_model.safetensors", "no tensors"),
]


@pytest.mark.parametrize("kw,fname,frag", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refusals(
    spec: ModelSpec, good: tuple[Path, Any], tmp_path: Path, kw: dict, fname: str, frag: str
) -> None:
    bad = rewrite(good[0], tmp_path / "bad", **kw)
    with pytest.raises(AdapterError) as ei:
        load_peft_adapter(bad, spec, max_rank=64)
    msg = str(ei.value)
    assert fname in msg and frag in msg, msg


def test_rank_over_max(spec: ModelSpec, good: tuple[Path, Any]) -> None:
    with pytest.raises(AdapterError, match=r"adapter_config\.json.*r=8 exceeds max_lora_rank=4"):
        load_peft_adapter(good[0], spec, max_rank=4)


def test_shape_mismatch_against_other_base(good: tuple[Path, Any]) -> None:
    other = spec_of({**tiny_config().to_dict(), "hidden_size": 96, "head_dim": 16})
    with pytest.raises(AdapterError, match="do not match the base"):
        load_peft_adapter(good[0], other, max_rank=64)


def test_missing_files(spec: ModelSpec, good: tuple[Path, Any], tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="does not exist"):
        load_peft_adapter(tmp_path / "nope", spec, max_rank=64)
    d = rewrite(good[0], tmp_path / "nocfg")
    (d / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match=r"adapter_config\.json.*missing"):
        load_peft_adapter(d, spec, max_rank=64)
    d = rewrite(good[0], tmp_path / "now")
    (d / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors.*missing"):
        load_peft_adapter(d, spec, max_rank=64)
    (d / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(AdapterError, match=r"adapter_model\.bin.*refused: only safetensors"):
        load_peft_adapter(d, spec, max_rank=64)


def test_corrupt_files(spec: ModelSpec, good: tuple[Path, Any], tmp_path: Path) -> None:
    d = rewrite(good[0], tmp_path / "badjson")
    (d / "adapter_config.json").write_text('{"peft_type": "LORA",')
    with pytest.raises(AdapterError, match=r"adapter_config\.json.*corrupt JSON"):
        load_peft_adapter(d, spec, max_rank=64)
    (d / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(AdapterError, match="must be a JSON object"):
        load_peft_adapter(d, spec, max_rank=64)
    d = rewrite(good[0], tmp_path / "badst")
    data = (d / "adapter_model.safetensors").read_bytes()
    (d / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors.*corrupt"):
        load_peft_adapter(d, spec, max_rank=64)
    (d / "adapter_model.safetensors").write_bytes(b"garbage!" * 4)
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors.*corrupt"):
        load_peft_adapter(d, spec, max_rank=64)


def test_real_peft_variants_refused(spec: ModelSpec, tmp_path: Path) -> None:
    # Adapters written by PEFT itself, not hand-edited configs.
    make_peft(tmp_path / "dora", use_dora=True, target_modules=["q_proj"])
    with pytest.raises(AdapterError, match="DoRA"):
        load_peft_adapter(tmp_path / "dora", spec, max_rank=64)
    make_peft(tmp_path / "mts", target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(AdapterError, match="modules_to_save"):
        load_peft_adapter(tmp_path / "mts", spec, max_rank=64)
    make_peft(tmp_path / "pissa", target_modules=["q_proj"], init_lora_weights="pissa")
    with pytest.raises(AdapterError, match="PiSSA"):  # PEFT rewrote the base when it made it
        load_peft_adapter(tmp_path / "pissa", spec, max_rank=64)
    make_peft(tmp_path / "gaussian", target_modules=["q_proj"], init_lora_weights="gaussian")
    load_peft_adapter(tmp_path / "gaussian", spec, max_rank=64)  # only A and B's start: served as is
    make_peft(tmp_path / "head", target_modules=["q_proj", "lm_head"])
    with pytest.raises(AdapterError, match=r"unsupported target_modules \['lm_head'\]"):
        load_peft_adapter(tmp_path / "head", spec, max_rank=64)
    torch.manual_seed(0)
    ia3 = peft.get_peft_model(
        transformers.LlamaForCausalLM(tiny_config()),
        peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
    )
    ia3.save_pretrained(str(tmp_path / "ia3"), safe_serialization=True)
    with pytest.raises(AdapterError, match="peft_type 'IA3'"):
        load_peft_adapter(tmp_path / "ia3", spec, max_rank=64)


def test_adapter_modules_mirror_the_model_declaration() -> None:
    """``MODULE_GROUP`` (adapters/ cannot import models/) must name exactly the PEFT modules the model
    declares, each under the submodule its linear lives in."""
    packed = LlamaForCausalLM.packed_modules_mapping
    supported = LlamaForCausalLM.supported_lora_modules  # fused modules are targets too (Phi-3 checkpoints)
    want = {p for m in supported for p in packed.get(m, [m])} | set(supported)
    assert set(MODULE_GROUP) == want
    assert {MODULE_GROUP[p] for p in packed["qkv_proj"]} == {"self_attn"}
    assert {MODULE_GROUP[p] for p in packed["gate_up_proj"]} == {"mlp"}


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_model_spec_matches_the_hf_modules_adapters_target(family: str) -> None:
    """ModelSpec.from_model (the model's own linears) names and sizes exactly the nn.Linear
    modules of HF's model, the ones PEFT wraps: q/k/v/gate/up for Llama, fused qkv/gate_up for Phi-3."""
    if family == "llama":
        hf_cfg = tiny_config()
        hf = transformers.LlamaForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.Phi3Config(
            vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
        )  # fmt: skip
        hf = transformers.Phi3ForCausalLM(hf_cfg)
    want = {
        name.rpartition(".")[2]: (m.in_features, m.out_features)
        for name, m in hf.model.layers[0].named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    spec = spec_of(hf_cfg.to_dict())
    assert spec.module_shapes == want
    assert spec.num_layers == hf_cfg.num_hidden_layers
