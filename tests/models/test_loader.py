"""Checkpoint loading: sharded index, dtypes, and errors that name the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from lorastar import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(40, 70))]


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_equals_single_file(tiny_model_dir, tmp_path: Path) -> None:
    src = tiny_model_dir("llama-gqa")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    sharded = _copy(src, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    model.save_pretrained(sharded, max_shard_size="2MB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    a = LLM(src, num_kv_blocks=64).generate(PROMPTS, GREEDY)
    b = LLM(str(sharded), num_kv_blocks=64).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_checkpoints_load(tiny_model_dir, tmp_path: Path, dtype: str) -> None:
    src = tiny_model_dir("qwen2")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype))
    d = _copy(src, tmp_path / dtype)
    model.save_pretrained(d)
    llm = LLM(str(d), dtype=dtype, num_kv_blocks=64)
    assert llm.engine.model.embed_tokens.weight.dtype == getattr(torch, dtype)
    out = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.outputs[0].token_ids) == 6 for o in out)
    # "auto" on CPU computes in fp32 whatever the checkpoint stores
    assert LLM(str(d), num_kv_blocks=64).engine.dtype == torch.float32


def test_unsupported_architecture_names_it(tiny_model_dir, tmp_path: Path) -> None:
    d = _copy(tiny_model_dir("llama-gqa"), tmp_path / "gpt2ish")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM"
    ):
        LLM(str(d))


def test_missing_and_misshapen_tensors_are_named(tiny_model_dir, tmp_path: Path) -> None:
    src = tiny_model_dir("llama-gqa")
    tensors = load_file(str(Path(src) / "model.safetensors"))
    d = _copy(src, tmp_path / "missing")
    t = dict(tensors)
    del t["model.layers.1.self_attn.k_proj.weight"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        LLM(str(d))
    d2 = _copy(src, tmp_path / "shape")
    t = dict(tensors)
    t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:, :10].contiguous()
    save_file(t, str(d2 / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*shape"):
        LLM(str(d2))
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))


def test_fused_and_split_tensors_load_alike_and_not_both(tiny_model_dir, tmp_path: Path) -> None:
    """Any family may store q/k/v (gate/up) fused, as Phi-3 does: same model either way. A checkpoint
    with both the fused tensor and its parts is refused (one would silently overwrite the other)."""
    src = tiny_model_dir("llama-gqa")
    tensors = load_file(str(Path(src) / "model.safetensors"))
    fused = dict(tensors)
    for i in range(2):
        b = f"model.layers.{i}"
        fused[f"{b}.self_attn.qkv_proj.weight"] = torch.cat(
            [fused.pop(f"{b}.self_attn.{m}_proj.weight") for m in "qkv"]
        )
        fused[f"{b}.mlp.gate_up_proj.weight"] = torch.cat(
            [fused.pop(f"{b}.mlp.{m}_proj.weight") for m in ("gate", "up")]
        )
    d = _copy(src, tmp_path / "fused")
    save_file(fused, str(d / "model.safetensors"))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(src, num_kv_blocks=16).generate([[5, 6, 7]], sp)[0].outputs[0].token_ids
    assert LLM(str(d), num_kv_blocks=16).generate([[5, 6, 7]], sp)[0].outputs[0].token_ids == want
    both = _copy(src, tmp_path / "both")
    save_file({**tensors, "model.layers.0.self_attn.qkv_proj.weight": fused["model.layers.0.self_attn.qkv_proj.weight"]},
              str(both / "model.safetensors"))  # fmt: skip
    with pytest.raises(ValueError, match=r"both the fused model\.layers\.0\.self_attn\.qkv_proj\.weight"):
        LLM(str(both))
