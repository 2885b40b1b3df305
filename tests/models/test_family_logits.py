"""Families whose differences from Llama are scalars or norm placement (Granite 3.x's four
multipliers, OLMo 2's post-norms and whole-projection q/k norms, OLMo 3's config as transformers
completes it): greedy tokens, and logits within 1e-4 relative at every decode step with the prefill
chunked, against transformers (greedy parity across all families runs in test_llama_vs_hf.py, OLMo 3's
windows in test_sliding_window.py)."""

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


def _decodes_as_transformers(path: str) -> None:
    """Greedy tokens, and logits at every decode step of the longer prompt, equal transformers'."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = mixed_prompts(14, [4, 70])
    llm = LLM(path, num_kv_blocks=64, block_size=8, max_num_batched_tokens=32)
    assert_decodes_as_hf(hf, llm, prompts, sp)


@pytest.mark.parametrize("name", ["granite", "olmo2"])
def test_decodes_as_transformers(tiny_model_dir, name: str) -> None:  # noqa: ANN001
    path = tiny_model_dir(name)
    if name == "granite":
        cfg = json.loads((Path(path) / "config.json").read_text())
        assert [cfg[k] for k in ("embedding_multiplier", "attention_multiplier", "residual_multiplier",
                                 "logits_scaling")] == [12.0, 0.1, 0.22, 8.0]  # fmt: skip
    _decodes_as_transformers(path)


def test_an_olmo3_config_without_the_derived_fields_reads_as_transformers_completes_it(
    tiny_model_dir, tmp_path
) -> None:  # noqa: ANN001
    """No ``layer_types`` (three local layers in four: both of these two), RoPE as 4.x wrote it
    (``rope_theta`` and a ``rope_scaling`` that transformers gives the global layers only)."""
    path = Path(shutil.copytree(tiny_model_dir("olmo3"), tmp_path / "bare"))
    cfg = json.loads((path / "config.json").read_text())
    for k in ("layer_types", "rope_parameters"):
        del cfg[k]
    cfg |= {
        "rope_theta": 20000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    }
    (path / "config.json").write_text(json.dumps(cfg))
    _decodes_as_transformers(str(path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_olmo2_norm_rounds_as_transformers(dtype: torch.dtype) -> None:
    """OLMo 2's norm multiplies by its weight in fp32 and rounds once: bit-equal to transformers'
    in fp32 and bf16 (Llama's form, rounding the normalized input first, differs in bf16)."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm as HFNorm

    from lorastar.layers.norm import RMSNorm
    from lorastar.models.olmo2 import Olmo2RMSNorm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 96, generator=g) * 3).to(dtype)
    w = (1 + 0.3 * torch.randn(96, generator=g)).to(dtype)
    ours, llama, ref = Olmo2RMSNorm(96, 1e-6, dtype), RMSNorm(96, 1e-6, dtype), HFNorm(96, 1e-6).to(dtype)
    for m in (ours, llama, ref):
        m.weight.data.copy_(w)
    with torch.no_grad():
        want = ref(x)
        assert torch.equal(ours(x), want)
        if dtype == torch.bfloat16:
            assert not torch.equal(llama(x), want)  # the rounding this norm exists for
