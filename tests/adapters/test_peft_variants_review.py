"""LoraConfig variants a user may train with, saved by real PEFT: each is served as PEFT computes it
or refused at load with an AdapterError naming the field (the registry left as it was)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lorastar.adapters.peft import ModelSpec, load_peft_adapter
from lorastar.errors import AdapterError
from tests.adapters.test_peft import check_against_peft, make_peft, rewrite, spec_of, tiny_config

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LLAMA_LIST = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return spec_of(tiny_config().to_dict())


def _lora_ga_model(seed: int) -> tuple[Any, Any]:
    """A tiny Llama and a LoRA-GA PeftModel on it (its base weights already less s * B0 @ A0)."""
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(tiny_config())
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], init_lora_weights="lora_ga",
        lora_ga_config=peft.LoraGAConfig(),
    )  # fmt: skip
    ids = torch.tensor([[5, 17, 23, 40, 77, 9, 31, 60]])
    peft.preprocess_loraga(base, cfg, lambda: base(input_ids=ids, labels=ids).loss.backward())
    return base, peft.get_peft_model(base, cfg)


def _train(pm: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def test_lora_ga_adapter_is_refused_and_its_conversion_served(spec: ModelSpec, tmp_path: Path) -> None:
    """LoRA-GA rewrites the base at init (W - s * B0 @ A0) like PiSSA/OLoRA, and PEFT's own
    from_pretrained cannot redo it (no gradients), so base + B @ A differs from the trained model:
    refused, naming init_lora_weights. Its PEFT conversion (a plain LoRA of rank 2r) is served and
    equals the trained model on the original base."""
    torch.manual_seed(0)
    original = {k: v.clone() for k, v in transformers.LlamaForCausalLM(tiny_config()).state_dict().items()}
    _, pm = _lora_ga_model(0)
    pm.save_pretrained(str(tmp_path / "init"))
    _train(pm, 1)
    pm.save_pretrained(str(tmp_path / "ga"))
    with pytest.raises(
        AdapterError, match=r"adapter_config\.json: refused: init_lora_weights='lora_ga'"
    ) as ei:
        load_peft_adapter(tmp_path / "ga", spec, max_rank=16)
    assert "path_initial_model_for_weight_conversion" in str(ei.value)

    pm.save_pretrained(
        str(tmp_path / "conv"), path_initial_model_for_weight_conversion=str(tmp_path / "init")
    )
    w = load_peft_adapter(tmp_path / "conv", spec, max_rank=16)
    assert w.rank == 8
    changed = {k.replace("base_layer.", ""): v.clone() for k, v in pm.base_model.model.state_dict().items()}
    trained = pm.merge_and_unload().state_dict()
    for (layer, module), (a, b) in w.weights.items():
        grp = "self_attn" if module == "q_proj" else "mlp"
        key = f"model.layers.{layer}.{grp}.{module}.weight"
        assert not torch.allclose(original[key], changed[key], atol=1e-4)  # LoRA-GA changed the base
        torch.testing.assert_close(original[key] + b @ a, trained[key], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "targets", [["q_proj", "v_proj", "qkv_proj", "gate_up_proj"], ["down_proj", "gate_up_proj"]]
)
def test_fused_names_a_llama_lacks_are_no_ops(spec: ModelSpec, tmp_path: Path, targets: list[str]) -> None:
    """A target list written for both layouts (Llama's q/k/v and Phi-3's qkv_proj/gate_up_proj):
    PEFT wraps only the modules the model has, so the fused names are no-ops, not a refusal."""
    pm = make_peft(tmp_path / "ad", seed=8, r=4, target_modules=targets)
    check_against_peft(tmp_path / "ad", pm, spec)


def test_fused_name_with_tensors_on_llama_is_still_refused(spec: ModelSpec, tmp_path: Path) -> None:
    pm_dir = tmp_path / "ad"
    make_peft(pm_dir, seed=9, r=4, target_modules=["q_proj", "gate_up_proj"])

    def add_fused(t: dict[str, torch.Tensor]) -> None:
        t["base_model.model.model.layers.0.mlp.gate_up_proj.lora_A.weight"] = torch.zeros(4, 64)
        t["base_model.model.model.layers.0.mlp.gate_up_proj.lora_B.weight"] = torch.zeros(256, 4)

    bad = rewrite(pm_dir, tmp_path / "bad", tensors=add_fused)
    with pytest.raises(AdapterError, match="unsupported target module 'gate_up_proj'"):
        load_peft_adapter(bad, spec, max_rank=16)


def test_phi3_adapter_trained_with_the_llama_target_list_is_served(tiny_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """On Phi-3 (fused qkv_proj / gate_up_proj) the usual Llama list makes PEFT adapt only o_proj and
    down_proj: served, token for token as PEFT."""
    from lorastar import LLM, SamplingParams
    from tests.adapters.test_lora_vs_peft import peft_greedy, peft_reference
    from tests.conftest import make_peft_adapter

    base_dir = tiny_model_dir("phi3")
    path = make_peft_adapter(base_dir, tmp_path / "ad", 21, r=4, targets=LLAMA_LIST)
    ref = peft_reference(base_dir, {"ad": path})
    llm = LLM(base_dir, num_kv_blocks=32, max_loras=1, max_lora_rank=8)
    info = llm.load_adapter("ad", path)
    assert set(info.target_modules) == {"o_proj", "down_proj"}
    prompt = [5, 17, 230, 4001, 77]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), adapter=["ad"])
    assert out[0].outputs[0].token_ids == peft_greedy(ref, prompt, "ad", 6)


def test_engine_variants_match_peft_and_refusals_keep_the_registry(tiny_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """End to end on a tiny Llama: rsLoRA with per-layer rank/alpha patterns, fan_in_fan_out (PEFT
    resets it for nn.Linear), and MiCA's frozen-B init decode as PEFT does; the same
    folder under two names (and a copy naming another base_model_name_or_path, which PEFT ignores)
    is one identity with unchanged outputs; refusals name the field and change nothing."""
    from lorastar import LLM, SamplingParams
    from tests.adapters.test_lora_vs_peft import peft_greedy, peft_reference
    from tests.conftest import make_peft_adapter

    base_dir = tiny_model_dir("llama-gqa")
    paths = {
        "rs": make_peft_adapter(
            base_dir, tmp_path / "rs", 31, r=4, targets=LLAMA_LIST, use_rslora=True,
            rank_pattern={r"layers\.1\..*_proj": 8, "q_proj": 2}, alpha_pattern={"down_proj": 5.5},
        ),
        "fifo": make_peft_adapter(base_dir, tmp_path / "fifo", 32, r=4, fan_in_fan_out=True),
        "mica": make_peft_adapter(base_dir, tmp_path / "mica", 33, r=4, init_lora_weights="mica"),
    }  # fmt: skip
    ref = peft_reference(base_dir, paths)
    llm = LLM(base_dir, num_kv_blocks=64, max_loras=3, max_lora_rank=8)
    for n, p in paths.items():
        llm.load_adapter(n, p)
    other = rewrite(
        Path(paths["rs"]), tmp_path / "rs-copy", cfg=lambda c: c.update(base_model_name_or_path="x/y")
    )
    llm.load_adapter("rs-again", paths["rs"])
    llm.load_adapter("rs-copy", str(other))
    listed = {i.name: i for i in llm.list_adapters()}
    assert listed["rs"].content_hash == listed["rs-again"].content_hash == listed["rs-copy"].content_hash
    assert llm.engine.registry.stats()["identities"] == 3

    order = [None, "rs", "fifo", "mica", "rs-again", "rs-copy"]
    prompts = [
        [5, 17, 230, 4001, 77],
        [9, 9, 31, 600],
        [12, 480, 3, 3, 1000],
        [7, 70, 700],
        [5, 17, 230],
        [44, 2],
    ]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), adapter=order)
    for p, a, o in zip(prompts, order, outs):
        assert o.outputs[0].token_ids == peft_greedy(
            ref, p, {"rs-again": "rs", "rs-copy": "rs"}.get(a, a), 5
        ), a
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:4]}) > 1

    before = llm.list_adapters()
    src = Path(paths["fifo"])
    refused = {
        "rank_pattern['v_proj']=16 exceeds max_lora_rank=8": rewrite(
            Path(paths["rs"]), tmp_path / "big", cfg=lambda c: c["rank_pattern"].update({"v_proj": 16})
        ),
        "modules_to_save": rewrite(src, tmp_path / "mts", cfg=lambda c: c.update(modules_to_save=["embed_tokens"])),
        "bias='lora_only'": rewrite(src, tmp_path / "bias", cfg=lambda c: c.update(bias="lora_only")),
        "use_dora": rewrite(src, tmp_path / "dora", cfg=lambda c: c.update(use_dora=True)),
        "lora_bias": rewrite(src, tmp_path / "lb", cfg=lambda c: c.update(lora_bias=True)),
    }  # fmt: skip
    for frag, folder in refused.items():
        for name in ("fifo", "new"):  # an existing name keeps its adapter; a new one is not added
            with pytest.raises(AdapterError, match="adapter_config.json") as ei:
                llm.load_adapter(name, str(folder))
            assert frag.replace("use_dora", "DoRA") in str(ei.value)
    assert llm.list_adapters() == before
    llm.engine.check_invariants()


def test_safetensors_preferred_and_bin_only_refused(spec: ModelSpec, tmp_path: Path) -> None:
    """PEFT's .bin (safe_serialization=False) is refused naming the file; beside a safetensors file
    it is ignored."""
    torch.manual_seed(0)
    pm = peft.get_peft_model(
        transformers.LlamaForCausalLM(tiny_config()), peft.LoraConfig(r=4, target_modules=["q_proj"])
    )
    _train(pm, 3)
    pm.save_pretrained(str(tmp_path / "bin"), safe_serialization=False)
    with pytest.raises(AdapterError, match=r"adapter_model\.bin.*only safetensors"):
        load_peft_adapter(tmp_path / "bin", spec, max_rank=16)
    pm.save_pretrained(str(tmp_path / "st"))
    shutil.copy(tmp_path / "bin" / "adapter_model.bin", tmp_path / "st" / "adapter_model.bin")
    check_against_peft(tmp_path / "st", pm, spec)
    assert json.loads((tmp_path / "st" / "adapter_config.json").read_text())["r"] == 4
