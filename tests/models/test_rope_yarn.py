"""YaRN RoPE (Qwen3's / Qwen2.5's long-context setting, Ministral 3): the frequencies and attention
factor equal transformers' own, and a model configured with it decodes as transformers does past the
original context (greedy tokens, and logits within 1e-4 relative at every decode step)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from lorastar import LLM, SamplingParams
from lorastar.layers.rotary import rope_inv_freq
from tests.models.test_llama_vs_hf import mixed_prompts
from tests.models.test_sliding_window import assert_decodes_as_hf


@pytest.mark.parametrize(
    "params",
    [
        {"factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen3's model card
        {"factor": 16.0, "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
         "mscale": 1.0, "mscale_all_dim": 1.0},  # Ministral 3's
        {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707},
        {"factor": 8.0, "original_max_position_embeddings": 64, "truncate": False},
        {"factor": 2.0, "original_max_position_embeddings": 2048, "attention_factor": 0.9, "beta_fast": 16.0},
        {"factor": 4.0, "original_max_position_embeddings": 512, "partial_rotary_factor": 0.5},
    ],
)  # fmt: skip
def test_yarn_frequencies_equal_transformers(params: dict) -> None:
    cfg = Qwen3Config(
        hidden_size=256, num_attention_heads=2, head_dim=128, max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, **params},
    )  # fmt: skip
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    got, factor = rope_inv_freq(cfg.to_dict(), 128)
    assert torch.equal(got, want.float())
    assert factor == want_factor


def test_qwen3_with_yarn_decodes_as_transformers(tiny_model_dir) -> None:  # noqa: ANN001
    path = tiny_model_dir("qwen3-yarn")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = mixed_prompts(12, [3, 60, 150])  # within and past the original 64 positions
    llm = LLM(path, num_kv_blocks=128, block_size=8, max_num_batched_tokens=32)
    assert_decodes_as_hf(hf, llm, prompts, sp)
