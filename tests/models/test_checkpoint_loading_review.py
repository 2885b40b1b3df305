"""Base checkpoints as users' HF folders hold them: corrupt / Git LFS pointer files, a stale index
left by save_pretrained, extra tensors vLLM skips (AutoGPTQ's zero biases, ColossalAI's RoPE caches),
malformed index / config files, and missing tensors named as the checkpoint names them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorastar.models.loader import load_model, read_hf_config
from tests.conftest import prefill_logits

IDS = list(range(30, 46))


def _copy(src: str, dst: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("tokenizer*"))
    if tensors is not None:
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _logits(d: str | Path) -> torch.Tensor:
    model, _ = load_model(
        d, read_hf_config(d), dtype=torch.float32, device=torch.device("cpu"), quant=None, max_positions=64
    )
    return prefill_logits(model, IDS)


@pytest.fixture(scope="module")
def src(tiny_model_dir) -> str:  # noqa: ANN001
    return tiny_model_dir("llama-gqa")


@pytest.fixture(scope="module")
def tensors(src: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(src) / "model.safetensors"))


@pytest.fixture(scope="module")
def want(src: str) -> torch.Tensor:
    return _logits(src)


def test_lfs_pointer_and_truncated_files_are_named(src: str, tmp_path: Path) -> None:
    """A repo cloned without git-lfs holds pointer files: a ValueError naming the file, not safetensors'
    bare SafetensorError (which the CLI shows as a traceback)."""
    d = _copy(src, tmp_path / "lfs")
    (d / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 9\n"
    )
    with pytest.raises(ValueError, match=r"lfs/model\.safetensors: corrupt safetensors.*git lfs pull"):
        _logits(d)
    d = _copy(src, tmp_path / "cut")
    (d / "model.safetensors").write_bytes((Path(src) / "model.safetensors").read_bytes()[:5000])
    with pytest.raises(ValueError, match=r"cut/model\.safetensors: corrupt safetensors"):
        _logits(d)


def test_zero_biases_of_bias_free_linears_are_skipped(
    src: str, tensors: dict[str, torch.Tensor], want: torch.Tensor, tmp_path: Path
) -> None:
    """AutoGPTQ exports store a zero bias for every linear of a bias-free model (Llama): vLLM skips
    them, transformers ignores them. A non-zero one still fails (the config says no bias)."""
    t = dict(tensors)
    for k, v in tensors.items():
        if k.endswith("_proj.weight"):
            t[k.removesuffix("weight") + "bias"] = torch.zeros(v.shape[0])
    d = _copy(src, tmp_path / "zero_bias", t)
    torch.testing.assert_close(_logits(d), want, rtol=0, atol=0)
    t["model.layers.1.mlp.down_proj.bias"] = torch.ones(64)
    d = _copy(src, tmp_path / "bias", t)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.bias.*no bias"):
        _logits(d)


def test_colossalai_rope_caches_are_skipped(
    src: str, tensors: dict[str, torch.Tensor], want: torch.Tensor, tmp_path: Path
) -> None:
    """vLLM's loaders skip ``rotary_emb.cos_cached`` / ``sin_cached`` (ColossalAI checkpoints)."""
    rope = {f"model.layers.0.self_attn.rotary_emb.{n}_cached": torch.ones(4, 8) for n in ("cos", "sin")}
    d = _copy(src, tmp_path / "rope", {**tensors, **rope})
    torch.testing.assert_close(_logits(d), want, rtol=0, atol=0)


def test_stale_index_beside_single_file_loads_it(src: str, want: torch.Tensor, tmp_path: Path) -> None:
    """save_pretrained of one file over a sharded save deletes the shards but keeps the index:
    transformers loads model.safetensors; lorastar did refuse ("missing checkpoint shard")."""
    d = _copy(src, tmp_path / "resaved")
    shards = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    index = {"metadata": {}, "weight_map": {"model.norm.weight": shards[0], "lm_head.weight": shards[1]}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    torch.testing.assert_close(_logits(d), want, rtol=0, atol=0)
    (d / "model.safetensors").unlink()  # no file to fall back on: the missing shard is named
    with pytest.raises(ValueError, match=r"missing checkpoint shard .*model-00001-of-00002\.safetensors"):
        _logits(d)


@pytest.mark.parametrize("text", ["{not json", '{"metadata": {}}', '{"weight_map": ["a"]}'])
def test_malformed_index_names_the_file(src: str, tmp_path: Path, text: str) -> None:
    d = _copy(src, tmp_path / "index")
    (d / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: not a safetensors index"):
        _logits(d)


def test_config_that_is_not_an_object_is_named(src: str, tmp_path: Path) -> None:
    d = _copy(src, tmp_path / "cfg")
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json: not a JSON object"):
        read_hf_config(d)


def test_missing_decoder_tensor_is_named_as_in_the_checkpoint(
    src: str, tensors: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """The error named ``norm.weight`` (which norm?): the checkpoint calls it ``model.norm.weight``."""
    t = {k: v for k, v in tensors.items() if k != "model.norm.weight"}
    d = _copy(src, tmp_path / "nonorm", t)
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model\.norm\.weight$"):
        _logits(d)
