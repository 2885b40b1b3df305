"""Engine settings and start-up failures (review): a bad value is refused at construction naming the
setting, before the model load where it can be, and a failed start leaves nothing behind."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

from lorastar.config import EngineConfig
from lorastar.engine.async_engine import AsyncLLM
from lorastar.engine.core_client import AsyncCoreClient
from lorastar.engine.engine import rope_scaled_max_len
from lorastar.engine.input_processor import load_tokenizer
from lorastar.engine.llm import LLM
from lorastar.engine.sampling import SamplingParams

FAST = {"cpu_gemm": "torch", "cpu_kernels": "torch"}  # no backend timing or C++ build at load


def _variant(src: str, dst: Path, files: tuple[str, ...], **config: Any) -> Path:
    """A copy of the tiny model folder (links to its files) with ``config`` over its config.json."""
    dst.mkdir()
    for f in files:
        (dst / f).symlink_to(Path(src) / f)
    cfg = json.loads((Path(src) / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    return dst


@pytest.mark.parametrize("seed", [None, "1", 1.0, True, 2**64, -(2**63) - 1])
def test_a_seed_the_sampler_cannot_take_is_refused_naming_it(seed: Any) -> None:
    # Was accepted, then failed after the model load inside torch ("manual_seed expected a long").
    with pytest.raises(ValueError, match="seed"):
        EngineConfig(seed=seed)


def test_seeds_over_the_whole_generator_range_are_accepted() -> None:
    for seed in (0, -1, -(2**63), 2**64 - 1):
        assert EngineConfig(seed=seed).seed == seed


@pytest.mark.parametrize("dtype", [None, 16, ["bfloat16"]])
def test_a_dtype_neither_a_name_nor_a_torch_dtype_is_refused_naming_it(dtype: Any) -> None:
    # Was accepted, then a bare KeyError in resolve_dtype once config.json had been read.
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype=dtype)


def test_a_missing_tokenizer_folder_is_refused_before_the_model_load(
    tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Was transformers' "Repo id must be in the form ..." OSError, after the whole model had loaded.
    import lorastar.engine.engine as engine_mod

    def no_load(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine_mod, "load_model", no_load)
    with pytest.raises(ValueError, match=r"tokenizer: folder '/nonexistent/tok' does not exist"):
        LLM(tiny_model_dir("llama-gqa"), tokenizer="/nonexistent/tok", **FAST)


def test_a_folder_without_a_tokenizer_is_named(tmp_path: Path) -> None:
    # transformers' "Couldn't instantiate the backend tokenizer ..." named neither folder nor setting.
    with pytest.raises(ValueError, match=rf"tokenizer: cannot load a tokenizer from '{tmp_path}'"):
        load_tokenizer(tmp_path)


def test_a_yarn_context_is_served_up_to_its_scaled_length_as_vllm(
    tiny_model_dir: Any, tmp_path: Path
) -> None:
    """vLLM derives a YaRN model's context as original_max_position_embeddings x factor (Qwen's
    guide: add rope_scaling, then --max-model-len 131072 over a max_position_embeddings of 40960);
    lorastar refused anything over max_position_embeddings."""
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 512,
    }
    src = tiny_model_dir("llama-gqa")
    files = ("model.safetensors", "tokenizer.json", "tokenizer_config.json")
    folder = _variant(src, tmp_path / "yarn", files, rope_parameters=rope, max_position_embeddings=512)
    llm = LLM(str(folder), max_model_len=1024, num_kv_blocks=72, **FAST)
    assert llm.engine.max_model_len == 1024
    out = llm.generate([[5] * 700], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 2  # positions past max_position_embeddings
    with pytest.raises(ValueError, match=r"max_model_len \(2049\) exceeds .* RoPE-scaled length \(2048\)"):
        LLM(str(folder), max_model_len=2049, num_kv_blocks=8, **FAST)


def test_rope_scaled_length_follows_vllms_derivation() -> None:
    base = {"max_position_embeddings": 4096}
    assert rope_scaled_max_len(base) == 0
    assert rope_scaled_max_len({**base, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}) == 8192
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    assert rope_scaled_max_len({**base, "rope_parameters": yarn}) == 4096
    # llama3 and longrope already count their scaling in max_position_embeddings
    assert rope_scaled_max_len({**base, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}}) == 0
    phi3 = {"type": "yarn", "short_factor": [1.0], "long_factor": [2.0], "factor": 4.0}
    assert rope_scaled_max_len({**base, "rope_scaling": phi3}) == 0
    # per layer type (OLMo 3); Gemma 3's max_position_embeddings is the scaled one (vLLM skips it)
    nested = {
        "full_attention": {"rope_type": "linear", "factor": 8.0},
        "sliding_attention": {"rope_type": "default"},
    }
    assert rope_scaled_max_len({**base, "rope_parameters": nested}) == 32768
    assert rope_scaled_max_len({**base, "model_type": "gemma3_text", "rope_parameters": nested}) == 0


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:notaport", "ipc:///tmp/" + "x" * 200])
def test_an_address_zmq_refuses_leaves_no_temp_folder(
    address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The client's lorastar-core-* folder (and zmq context) were left behind by a failed connect.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(Exception, match="addr="):
        AsyncCoreClient(EngineConfig(), address=address)
    assert list(tmp_path.iterdir()) == []


def test_engine_options_beside_a_config_are_refused_not_ignored(tmp_path: Path) -> None:
    # They were silently dropped: the engine ran on the config alone.
    cfg = EngineConfig(model=str(tmp_path / "never-loaded"))
    with pytest.raises(ValueError, match=r"give config or engine options \(max_model_len, model\), not both"):
        LLM("other", config=cfg, max_model_len=64)
    with pytest.raises(ValueError, match=r"\(max_num_seqs\), not both"):
        AsyncLLM(cfg, max_num_seqs=2)
    with pytest.raises(ValueError, match=r"\(max_num_seqs\), not both"):
        AsyncCoreClient(cfg, max_num_seqs=2)


def test_a_max_model_len_the_cache_cannot_hold_is_lowered_with_a_warning(
    tiny_model_dir: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM refuses a max_model_len its KV cache cannot hold; lorastar serves what fits, but it
    lowered an explicit setting without a word."""
    with caplog.at_level("WARNING", logger="lorastar"):
        llm = LLM(tiny_model_dir("llama-gqa"), max_model_len=256, num_kv_blocks=4, block_size=16, **FAST)
    assert llm.engine.max_model_len == 64
    assert any("max_model_len=256" in r.message and "lowered to 64" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="lorastar"):
        LLM(tiny_model_dir("llama-gqa"), max_model_len=64, num_kv_blocks=4, block_size=16, **FAST)
    assert not [r for r in caplog.records if "max_model_len" in r.message]


@pytest.mark.parametrize(("alias", "dtype"), [("half", "float16"), ("float", "float32")])
def test_vllms_dtype_aliases_are_taken(alias: str, dtype: str) -> None:
    # `vllm serve --dtype half` is common in deployment scripts; lorastar refused it.
    assert EngineConfig(dtype=alias).dtype == dtype


def test_max_loras_past_64_alone_keeps_them_all_in_host_memory() -> None:
    # max_cpu_loras defaulted to 64 in Python (max(64, max_loras) in `lorastar serve`, max_loras in
    # vLLM): EngineConfig(max_loras=100) was refused, naming an option its user never set.
    assert EngineConfig(max_loras=100).max_cpu_loras == 100
    assert EngineConfig().max_cpu_loras == 64
    assert EngineConfig(max_loras=2, max_cpu_loras=3).max_cpu_loras == 3
    with pytest.raises(ValueError, match=r"max_cpu_loras \(4\) must be >= max_loras \(8\)"):
        EngineConfig(max_cpu_loras=4)
