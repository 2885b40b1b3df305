"""Sliding-window / hybrid families against transformers where their configs differ from the tests'
own: Gemma configs as transformers 4.x wrote them, the shape of Google's checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorastar import LLM, SamplingParams
from tests.models.test_llama_vs_hf import mixed_prompts
from tests.models.test_sliding_window import assert_decodes_as_hf


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_a_gemma_config_without_tie_word_embeddings_is_tied_as_transformers_reads_it(
    tiny_model_dir, tmp_path, name: str
) -> None:  # noqa: ANN001
    """transformers 4.x wrote no field equal to its base config's default (tied), so Gemma 2's and
    Gemma 3 1B's config.json omit ``tie_word_embeddings`` and the checkpoint stores no lm_head;
    Gemma's config classes default it to true. Also the 4.x RoPE and window fields (no
    ``layer_types`` / nested ``rope_parameters``). Loads tied and decodes as transformers."""
    path = Path(shutil.copytree(tiny_model_dir(name), tmp_path / name))
    cfg = json.loads((path / "config.json").read_text())
    for k in ("tie_word_embeddings", "layer_types", "rope_parameters", "_sliding_window_pattern"):
        cfg.pop(k, None)
    if name == "gemma3":  # local, global, local; the global RoPE linearly scaled
        cfg |= {"sliding_window_pattern": 2, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                "rope_scaling": {"rope_type": "linear", "factor": 2.0}}  # fmt: skip
    else:
        cfg["rope_theta"] = 10000.0
    (path / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings
    llm = LLM(str(path), num_kv_blocks=64, block_size=8, max_num_batched_tokens=16)
    assert llm.engine.runner.model.tie_word_embeddings
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert_decodes_as_hf(hf, llm, mixed_prompts(3, [5, 70]), sp)  # 70 + 30: several windows
    llm.engine.check_invariants()
    assert llm.kv_cache_usage()["num_used_blocks"] == 0
