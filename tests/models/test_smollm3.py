"""SmolLM3's config as transformers completes it: a config.json without ``no_rope_layers``,
``layer_types`` or a RoPE base (hand-written, or saved by an older transformers) gets transformers'
NoPE layers, sliding layers and base 2,000,000, not Llama's 10,000 (HF logits are the reference;
greedy parity with NoPE layers and windows runs in test_llama_vs_hf.py and test_sliding_window.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from lorastar import LLM, SamplingParams
from tests.models.test_llama_vs_hf import mixed_prompts
from tests.models.test_sliding_window import assert_decodes_as_hf

LONG = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_a_config_without_the_derived_fields_reads_as_transformers_completes_it(
    tiny_model_dir, tmp_path
) -> None:  # noqa: ANN001
    path = Path(shutil.copytree(tiny_model_dir("smollm3-window"), tmp_path / "bare"))
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["no_rope_layers"] == [1, 0] and cfg["layer_types"] == ["full_attention", "sliding_attention"]
    for k in ("no_rope_layers", "layer_types", "rope_parameters"):
        del cfg[k]
    (path / "config.json").write_text(json.dumps(cfg))

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_theta"] == 2_000_000.0
    prompts = mixed_prompts(6, [7, 90])
    llm = LLM(str(path), num_kv_blocks=64, block_size=8, max_num_batched_tokens=32)
    assert_decodes_as_hf(hf, llm, prompts, LONG)
