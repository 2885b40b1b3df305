"""Gemma 3 4B-27B checkpoints (``Gemma3ForConditionalGeneration``) served as text: the language model
loads under both namings transformers has written and from a partial ``text_config``, the vision tower
is not loaded, and adapters trained on the multimodal model apply as PEFT applies them, their vision
tensors skipped (HF greedy decoding and PEFT greedy decoding are the references; the greedy and
logit parity over many sliding windows and the mixed-adapter batch run in test_sliding_window.py and
test_lora_vs_peft.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from lorastar import LLM, SamplingParams
from lorastar.errors import AdapterError
from tests.adapters.test_lora_vs_peft import peft_greedy, peft_reference
from tests.conftest import make_peft_adapter
from tests.models.test_llama_vs_hf import hf_greedy, mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
RENAMED = {"language_model.model.": "model.language_model.", "vision_tower.": "model.vision_tower.",
           "multi_modal_projector.": "model.multi_modal_projector."}  # fmt: skip


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_both_namings_and_a_partial_text_config_serve_the_multimodal_models_text(
    tiny_model_dir, tmp_path
) -> None:  # noqa: ANN001
    path = tiny_model_dir("gemma3-mm")
    stored = load_file(str(Path(path) / "model.safetensors"))
    assert any(k.startswith("vision_tower.") for k in stored)  # transformers writes the released naming
    # transformers >= 4.52's module paths, with a top-level lm_head (tied here: a stored copy is ignored)
    newer = _copy(path, tmp_path / "newer")
    renamed = {}
    for k, v in stored.items():
        old = next((o for o in RENAMED if k.startswith(o)), None)
        renamed[RENAMED[old] + k[len(old) :] if old else k] = v
    renamed["lm_head.weight"] = stored["language_model.model.embed_tokens.weight"].clone()
    assert set(renamed) != set(stored)
    save_file(renamed, str(newer / "model.safetensors"), metadata={"format": "pt"})
    # The released configs list only the text fields that differ from Gemma3TextConfig's defaults.
    partial = _copy(path, tmp_path / "partial")
    cfg = json.loads((partial / "config.json").read_text())
    defaults = Gemma3TextConfig().to_dict()
    cfg["text_config"] = {
        k: v for k, v in cfg["text_config"].items() if k not in defaults or defaults[k] != v
    }
    assert "rms_norm_eps" not in cfg["text_config"] and "hidden_activation" not in cfg["text_config"]
    (partial / "config.json").write_text(json.dumps(cfg))

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Gemma3ForConditionalGeneration"
    prompts = mixed_prompts(3, [1, 9, 30, 64])
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    for folder in (path, newer, partial):
        llm = LLM(str(folder), num_kv_blocks=64, block_size=8)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        assert got == want, folder
    # Only the language model is loaded: as many parameters as HF's language model (lm_head tied;
    # dense weights: oneDNN's packed copies are no parameters).
    dense = LLM(str(partial), num_kv_blocks=16, cpu_gemm="torch").engine.model
    served = sum(p.numel() for p in dense.parameters())
    assert served == sum(p.numel() for p in hf.model.language_model.parameters())
    assert served < sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize(
    ("targets", "vision"),
    [
        (["q_proj", "fc1", "out_proj"], True),  # PEFT wraps q_proj in both towers, fc1/out_proj in SigLIP
        (r".*language_model.*\.(v_proj|down_proj)", False),  # a regex on the multimodal model's paths
    ],
)
def test_adapters_of_the_multimodal_model_apply_as_peft_applies_them(
    tiny_model_dir, tmp_path, targets: list[str] | str, vision: bool
) -> None:  # noqa: ANN001
    path = tiny_model_dir("gemma3-mm")
    adapter = make_peft_adapter(
        path, tmp_path / "a", seed=5, targets=["unused"], map_targets=lambda b, n: targets
    )
    keys = load_file(str(Path(adapter) / "adapter_model.safetensors"))
    assert any("vision_tower" in k for k in keys) == vision
    assert all(k.startswith("base_model.model.model.") for k in keys)  # PEFT's module paths
    ref = peft_reference(path, {"a": adapter})
    llm = LLM(path, num_kv_blocks=64, block_size=8, max_loras=2, max_lora_rank=8)
    llm.load_adapter("a", adapter)
    prompts = mixed_prompts(4, [5, 27, 40])
    names = ["a", None, "a"]
    outs = llm.generate(prompts, GREEDY, adapter=names)
    for p, name, o in zip(prompts, names, outs):
        assert o.outputs[0].token_ids == peft_greedy(ref, p, name, GREEDY.max_tokens)
    assert outs[0].outputs[0].token_ids != llm.generate(prompts[:1], GREEDY)[0].outputs[0].token_ids
    llm.engine.check_invariants()


def test_an_adapter_of_the_vision_tower_alone_is_refused(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    path = tiny_model_dir("gemma3-mm")
    adapter = make_peft_adapter(
        path,
        tmp_path / "v",
        seed=6,
        targets=["unused"],
        map_targets=lambda b, n: r".*vision_tower.*\.(fc1|fc2)",
    )
    llm = LLM(path, num_kv_blocks=32, max_loras=1, max_lora_rank=8)
    with pytest.raises(AdapterError, match="nothing applies to text"):
        llm.load_adapter("v", adapter)
    assert llm.list_adapters() == []
    # On a text-only base the same names stay refused: fc1 is no module of a Llama decoder.
    text_only = make_peft_adapter(tiny_model_dir("gemma3"), tmp_path / "t", seed=6, targets=["q_proj"])
    cfg_path = Path(text_only) / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["target_modules"] = ["q_proj", "fc1"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="unsupported target_modules"):
        LLM(tiny_model_dir("gemma3"), num_kv_blocks=32, max_loras=1, max_lora_rank=8).load_adapter(
            "t", text_only
        )


def test_the_released_4b_config_reads_as_gemma_3_4bs_decoder() -> None:
    """google/gemma-3-4b-it's config.json as released (its text_config lists six fields): the rest
    comes from transformers' defaults, the top level's eos ids and dtype win, and each layer type
    gets its RoPE (local 10k; global 1M, linearly scaled by 8) as the model card's architecture."""
    from lorastar.models.gemma import _rope_config
    from lorastar.models.registry import model_class

    released = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
        "torch_dtype": "bfloat16", "mm_tokens_per_image": 256, "vision_config": {"hidden_size": 1152},
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
    }  # fmt: skip
    cls = model_class(released)
    cfg = cls.text_config(released)
    assert cls.__name__ == "Gemma3ForConditionalGeneration"
    got = {k: cfg[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                               "query_pre_attn_scalar", "eos_token_id", "torch_dtype", "tie_word_embeddings")}  # fmt: skip
    assert got == {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 262208,
                   "query_pre_attn_scalar": 256, "eos_token_id": [1, 106], "torch_dtype": "bfloat16",
                   "tie_word_embeddings": True}  # fmt: skip
    assert cfg["layer_types"].count("full_attention") == 5 and cfg["layer_types"][5] == "full_attention"
    assert _rope_config(cfg, "sliding_attention")["rope_parameters"]["rope_theta"] == 10000.0
    full = _rope_config(cfg, "full_attention")["rope_parameters"]
    assert (full["rope_type"], full["factor"], full["rope_theta"]) == ("linear", 8.0, 1000000.0)


def test_an_adapter_of_the_multimodal_model_on_a_text_only_base_says_so(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    """Its keys name language_model / vision_tower paths that a text-only base (Gemma 3 1B's
    Gemma3ForCausalLM here) does not have: the error says what the adapter is, not just "unsupported"."""
    adapter = make_peft_adapter(
        tiny_model_dir("gemma3-mm"), tmp_path / "a", seed=7, targets=["q_proj", "v_proj"]
    )
    llm = LLM(tiny_model_dir("gemma3"), num_kv_blocks=32, max_loras=1, max_lora_rank=8)
    with pytest.raises(AdapterError, match="adapts a multimodal model"):
        llm.load_adapter("a", adapter)
    assert llm.list_adapters() == []
