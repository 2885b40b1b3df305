"""A checkpoint that stores its decoder without the ``model.`` prefix and without an lm_head, as
Qwen3-Embedding's released checkpoints do (``embed_tokens.weight``, ``layers.*``, ``norm.weight``):
loaded under ``model.``, its embeddings equal HF ``AutoModel``'s and a PEFT adapter trained on the
backbone (module paths without ``model.``) equals PEFT's; a tied one generates as the full model."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorastar import LLM, SamplingParams

TOL = 1e-4


def _bare(src: str, out: Path) -> Path:
    """``src`` with its tensors renamed as a backbone: ``model.`` dropped, the lm_head left out."""
    shutil.copytree(src, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(str(f))
        save_file(
            {k.removeprefix("model."): v for k, v in tensors.items() if not k.startswith("lm_head.")},
            str(f),
            metadata={"format": "pt"},
        )
    return out


def _hf_backbone(path: Path, ids: list[int], adapter: Path | None = None) -> torch.Tensor:
    from transformers import AutoModel

    model: Any = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1].float()


@pytest.mark.parametrize("arch", ["qwen3-tied", "llama-gqa"])  # tied, untied (no lm_head at all then)
def test_a_bare_backbone_embeds_as_transformers(tiny_model_dir: Any, tmp_path: Path, arch: str) -> None:
    full = tiny_model_dir(arch)
    bare = _bare(full, tmp_path / "bare")
    ids = list(range(100, 140))
    llm = LLM(str(bare), num_kv_blocks=64, max_model_len=128)
    got = torch.tensor(llm.embed([ids], normalize=False)[0].outputs.embedding)
    assert (got - _hf_backbone(bare, ids)).abs().max().item() <= TOL
    if arch == "qwen3-tied":  # tied: the full model's lm_head is the table, so generation is the full model's
        greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        ref = LLM(full, num_kv_blocks=64, max_model_len=128).generate([ids], greedy)[0].outputs[0].token_ids
        assert llm.generate([ids], greedy)[0].outputs[0].token_ids == ref


def test_an_adapter_of_the_backbone_equals_peft(tiny_model_dir: Any, tmp_path: Path) -> None:
    """PEFT on ``AutoModel`` (sentence-transformers' way) writes ``layers.N...`` module paths."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    bare = _bare(tiny_model_dir("qwen3"), tmp_path / "bare")
    peft = get_peft_model(
        AutoModel.from_pretrained(str(bare), dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0),
    )
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft.save_pretrained(tmp_path / "adapter")
    ids = list(range(7, 40))
    llm = LLM(str(bare), num_kv_blocks=64, max_model_len=128)
    llm.load_adapter("st", str(tmp_path / "adapter"))
    got = torch.tensor(llm.embed([ids], adapter="st", normalize=False)[0].outputs.embedding)
    want = _hf_backbone(bare, ids, tmp_path / "adapter")
    assert (got - want).abs().max().item() <= TOL
    assert (want - _hf_backbone(bare, ids)).abs().max().item() > 1e-3  # the adapter changes it


def test_a_backbone_saved_as_its_own_class_is_served(tiny_model_dir: Any, tmp_path: Path) -> None:
    """``AutoModel(...).save_pretrained`` writes ``architectures: ["Qwen3Model"]`` and bare tensors
    (a full sentence-transformers fine-tune): served by Qwen3ForCausalLM, embeddings as HF's."""
    from transformers import AutoModel

    full = Path(tiny_model_dir("qwen3-tied"))
    out = tmp_path / "backbone"
    AutoModel.from_pretrained(str(full), dtype=torch.float32).save_pretrained(out)
    for f in full.iterdir():  # the tokenizer's files
        if f.name.startswith("tokenizer") or f.name.endswith((".jinja", "special_tokens_map.json")):
            shutil.copy(f, out / f.name)
    assert "Qwen3Model" in (out / "config.json").read_text()
    ids = list(range(50, 80))
    llm = LLM(str(out), num_kv_blocks=64, max_model_len=128)
    got = torch.tensor(llm.embed([ids], normalize=False)[0].outputs.embedding)
    assert (got - _hf_backbone(out, ids)).abs().max().item() <= TOL
