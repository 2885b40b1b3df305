"""Adapter configs PEFT reads in ways the loader must follow: ``exclude_modules`` and
``layers_to_transform`` (PEFT ignores the tensors of modules they leave out), "all-linear" in any
case, invalid pattern regexes (an AdapterError, not a crash) and VeLoRA's training-only buffer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lorastar.adapters.peft import ModelSpec, load_peft_adapter
from lorastar.errors import AdapterError
from tests.adapters.test_peft import (
    check_against_peft,
    make_peft,
    peft_lora_pairs,
    rewrite,
    spec_of,
    tiny_config,
)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return spec_of(tiny_config().to_dict())


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT adapter on every linear of both layers."""
    d = tmp_path_factory.mktemp("full") / "ad"
    make_peft(d, seed=5)
    return d


def _peft_applied(folder: Path) -> set[tuple[int, str]]:
    """The (layer, module) pairs whose saved weights PEFT loads (a module it wraps but finds no
    tensor for keeps B = 0)."""
    torch.manual_seed(0)
    pm = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM(tiny_config()), str(folder))
    return {k for k, (_, b, _) in peft_lora_pairs(pm).items() if b.abs().sum() > 0}


NARROWING: list[tuple[str, dict[str, Any], str]] = [
    ("layers_list", {"layers_to_transform": [0]}, "layers_to_transform=[0]"),
    ("layers_int_pattern", {"layers_to_transform": 1, "layers_pattern": "layers"}, "layers_to_transform=1"),
    ("exclude_list", {"exclude_modules": ["q_proj"]}, "exclude_modules=['q_proj']"),
    ("exclude_regex", {"exclude_modules": r".*layers\.1\..*"}, "exclude_modules="),
]


@pytest.mark.parametrize("upd,frag", [c[1:] for c in NARROWING], ids=[c[0] for c in NARROWING])
def test_config_narrowing_the_targets_is_honoured(
    spec: ModelSpec, full: Path, tmp_path: Path, upd: dict[str, Any], frag: str
) -> None:
    """A config whose exclude_modules / layers_to_transform leave out modules the file has tensors
    for: PEFT drops those tensors, so serving them would differ from PEFT. Refused, naming the field."""
    d = rewrite(full, tmp_path / "ad", cfg=lambda c: c.update(upd))
    every = {(layer, m) for layer in range(2) for m in ("q_proj", "v_proj", "down_proj")}
    assert not every <= _peft_applied(d)  # PEFT really leaves some of them out
    with pytest.raises(AdapterError, match="PEFT ignores its tensors") as ei:
        load_peft_adapter(d, spec, max_rank=64)
    assert frag in str(ei.value) and "adapter_config.json" in str(ei.value)


@pytest.mark.parametrize(
    "kw",
    [
        {"layers_to_transform": [1]},
        {"layers_to_transform": 0, "layers_pattern": "layers"},
        {"layers_to_transform": [0, 1], "layers_pattern": ["h", "layers"]},
        {"exclude_modules": ["model.layers.0.self_attn.q_proj", "down_proj"]},
        {"exclude_modules": r".*layers\.1\.mlp\..*"},
    ],
)
def test_peft_made_narrowed_adapters_load(spec: ModelSpec, tmp_path: Path, kw: dict[str, Any]) -> None:
    pm = make_peft(tmp_path / "ad", seed=6, **kw)
    check_against_peft(tmp_path / "ad", pm, spec)


def test_all_linear_in_any_case(spec: ModelSpec, full: Path, tmp_path: Path) -> None:
    """PEFT lowercases target_modules before comparing it with "all-linear"."""
    d = rewrite(full, tmp_path / "ad", cfg=lambda c: c.update(target_modules="ALL-Linear"))
    w = load_peft_adapter(d, spec, max_rank=64)
    assert set(w.weights) == _peft_applied(d)
    assert w.content_hash == load_peft_adapter(full, spec, max_rank=64).content_hash


@pytest.mark.parametrize(
    "upd,frag",
    [
        ({"rank_pattern": {"q_proj(": 4}}, "rank_pattern key regex 'q_proj('"),
        ({"alpha_pattern": {"[down": 4}}, "alpha_pattern key regex"),
        ({"exclude_modules": "(q_proj"}, "exclude_modules regex"),
        ({"exclude_modules": 3}, "exclude_modules must be"),
        ({"layers_to_transform": [0, "1"]}, "layers_to_transform must be"),
        ({"layers_to_transform": True}, "layers_to_transform must be"),
        ({"layers_to_transform": [0], "layers_pattern": "lay(ers"}, "layers_pattern regex"),
        ({"layers_to_transform": [0], "layers_pattern": 7}, "layers_pattern must be"),
    ],
)
def test_malformed_narrowing_fields_are_adapter_errors(
    spec: ModelSpec, full: Path, tmp_path: Path, upd: dict[str, Any], frag: str
) -> None:
    """Hand-edited configs: an AdapterError (HTTP 400 naming the problem), never re.error/TypeError."""
    d = rewrite(full, tmp_path / "ad", cfg=lambda c: c.update(upd))
    with pytest.raises(AdapterError) as ei:
        load_peft_adapter(d, spec, max_rank=64)
    assert frag in str(ei.value) and "adapter_config.json" in str(ei.value), str(ei.value)


def test_velora_adapter_is_served_as_plain_lora(spec: ModelSpec, tmp_path: Path) -> None:
    """VeLoRA changes only the training backward; its saved projection buffer is not a LoRA weight."""
    pm = make_peft(tmp_path / "ad", seed=7, velora_config=peft.tuners.lora.config.VeloraConfig())
    check_against_peft(tmp_path / "ad", pm, spec)


def test_only_training_buffers_is_refused(spec: ModelSpec, full: Path, tmp_path: Path) -> None:
    def only_velora(t: dict[str, torch.Tensor]) -> None:
        t.clear()
        t["base_model.model.model.layers.0.mlp.up_proj.lora_velora_embed"] = torch.ones(1)

    d = rewrite(full, tmp_path / "ad", tensors=only_velora)
    with pytest.raises(AdapterError, match="no LoRA A/B weights"):
        load_peft_adapter(d, spec, max_rank=64)


def test_engine_serves_peft_variants_and_keeps_state_on_refusal(tiny_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """End to end on a tiny Llama: a VeLoRA adapter and one narrowed by layers_to_transform,
    exclude_modules and regex rank/alpha patterns decode as PEFT does; a config that narrows the
    targets of tensors present is refused and leaves the registry (names, slots) as it was."""
    import json

    from lorastar import LLM, SamplingParams
    from tests.adapters.test_lora_vs_peft import peft_greedy, peft_reference
    from tests.conftest import make_peft_adapter

    base_dir = tiny_model_dir("llama-gqa")
    paths = {
        "velora": make_peft_adapter(
            base_dir, tmp_path / "velora", 11, r=4, velora_config=peft.tuners.lora.config.VeloraConfig()
        ),
        "narrow": make_peft_adapter(
            base_dir,
            tmp_path / "narrow",
            12,
            r=4,
            targets=("q_proj", "k_proj", "v_proj", "down_proj"),
            layers_to_transform=[1],
            exclude_modules=["k_proj"],
            rank_pattern={r"layers\.1\.self_attn\.(q|v)_proj": 8},
            alpha_pattern={r".*mlp\..*": 3},
        ),  # fmt: skip
    }
    ref = peft_reference(base_dir, paths)
    llm = LLM(base_dir, num_kv_blocks=64, max_loras=2, max_lora_rank=8)
    for n, p in paths.items():
        llm.load_adapter(n, p)
    order = [None, "velora", "narrow"]
    prompts = [[5, 17, 230, 4001, 77], [9, 9, 31, 600], [12, 480, 3, 3, 1000, 2222]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), adapter=order)
    for p, a, o in zip(prompts, order, outs):
        assert o.outputs[0].token_ids == peft_greedy(ref, p, a, 6), f"adapter {a}"

    before = llm.engine.registry.list()
    bad = rewrite(Path(paths["velora"]), tmp_path / "bad", cfg=lambda c: c.update(layers_to_transform=[0]))
    assert json.loads((bad / "adapter_config.json").read_text())["layers_to_transform"] == [0]
    with pytest.raises(AdapterError, match="layers_to_transform"):
        llm.load_adapter("velora", str(bad))
    assert llm.engine.registry.list() == before
    llm.engine.check_invariants()
