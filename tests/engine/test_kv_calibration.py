"""FP8 KV scales computed at load time (no scales in the checkpoint), against the K/V that HF
transformers caches for the same text; broken scale sets in a checkpoint are refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lorastar import LLM, SamplingParams
from lorastar.engine.kv_calibration import CALIBRATION_TEXT, HEADROOM


@pytest.mark.parametrize(("name", "kv"), [("llama-gqa", "fp8"), ("qwen2", "fp8_e5m2")])
def test_computed_scales_follow_hf_kv_cache(tiny_model_dir, name: str, kv: str) -> None:
    path = tiny_model_dir(name)
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_dtype=kv, num_kv_blocks=64)
    fp8_max = float(torch.finfo(torch.float8_e4m3fn if kv == "fp8" else torch.float8_e5m2).max)
    k_scales, v_scales = llm.engine.kv_scales

    ids = AutoTokenizer.from_pretrained(path)(CALIBRATION_TEXT, return_tensors="pt").input_ids
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = hf(ids, use_cache=True).past_key_values
    for i, layer in enumerate(cache.layers):  # keys after RoPE, as both caches store them
        torch.testing.assert_close(
            k_scales[i], HEADROOM * float(layer.keys.abs().max()) / fp8_max, rtol=1e-5, atol=0
        )
        torch.testing.assert_close(
            v_scales[i], HEADROOM * float(layer.values.abs().max()) / fp8_max, rtol=1e-5, atol=0
        )

    # The computed scales are what the cache uses, and generation still works end to end.
    assert llm.engine.runner.k_scales == k_scales and llm.engine.runner.v_scales == v_scales
    out = llm.generate([[5, 6, 7, 8] * 8], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
    assert llm.kv_cache_usage()["num_used_blocks"] == 0


def test_unquantized_cache_keeps_unit_scales(tiny_model_dir) -> None:
    llm = LLM(tiny_model_dir("llama-gqa"), device="cpu", dtype="float32", num_kv_blocks=16)
    assert llm.engine.kv_scales == ([1.0, 1.0], [1.0, 1.0])


def test_partial_checkpoint_scales_are_refused(tiny_model_dir, tmp_path: Path) -> None:
    src = Path(tiny_model_dir("llama-gqa"))
    dst = tmp_path / "partial-scales"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.05)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.v_scale"):
        LLM(str(dst), device="cpu", dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=16)
