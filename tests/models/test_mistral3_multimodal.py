"""Mistral Small 3.1/3.2 checkpoints (``Mistral3ForConditionalGeneration``) served as text: the
language model loads under both namings transformers has written, its lm_head tied or not exactly as
transformers decides it, the Pixtral vision tower and projector are not loaded, and adapters trained on
the multimodal model apply as PEFT applies them (HF greedy decoding and PEFT greedy decoding are the
references; the mixed-adapter batch also runs in test_lora_vs_peft.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Mistral3ForConditionalGeneration

from lorastar import LLM, SamplingParams
from lorastar.errors import AdapterError
from tests.adapters.test_lora_vs_peft import peft_greedy, peft_reference
from tests.conftest import make_peft_adapter
from tests.models.test_llama_vs_hf import hf_greedy, mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
RENAMED = {"language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head.",
           "vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector."}  # fmt: skip
EMBED, HEAD = "language_model.model.embed_tokens.weight", "language_model.lm_head.weight"


def _variant(src: str, dst: Path, tensors: dict[str, torch.Tensor], **top: object) -> Path:
    """A copy of ``src`` with these tensors and these top-level config fields."""
    shutil.copytree(src, dst)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **top}))
    return dst


def _hf(path: str | Path) -> Mistral3ForConditionalGeneration:
    return Mistral3ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()


def _greedy(path: str | Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(path), num_kv_blocks=64, block_size=8)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_both_namings_serve_the_multimodal_models_text(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    path = tiny_model_dir("mistral3-mm")
    stored = load_file(str(Path(path) / "model.safetensors"))
    assert HEAD in stored and any(k.startswith("vision_tower.transformer.") for k in stored)
    renamed = {}
    for k, v in stored.items():
        old = next(o for o in (*RENAMED, "") if k.startswith(o))
        renamed[RENAMED.get(old, "") + k[len(old) :] if old else k] = v
    assert "lm_head.weight" in renamed and "model.language_model.norm.weight" in renamed
    newer = _variant(path, tmp_path / "newer", renamed)

    hf = _hf(path)
    prompts = mixed_prompts(3, [1, 9, 30, 64])
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    assert _greedy(path, prompts) == want
    assert _greedy(newer, prompts) == want
    # Only the language model is loaded: as many parameters as HF's language model and lm_head
    # (dense weights: oneDNN's packed copies are no parameters).
    dense = LLM(path, num_kv_blocks=16, cpu_gemm="torch").engine.model
    served = sum(p.numel() for p in dense.parameters())
    language = sum(p.numel() for p in hf.model.language_model.parameters()) + hf.lm_head.weight.numel()
    assert served == language < sum(p.numel() for p in hf.parameters())


def test_the_lm_head_is_tied_exactly_where_transformers_ties_it(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    """transformers 5's ``Mistral3Config`` defaults the top-level ``tie_word_embeddings`` to true, and
    the released configs do not write it: a fine-tune saved by transformers then says "tied" beside
    its own lm_head, which transformers loads untied (it ties only a head that is missing or equal)."""
    path = tiny_model_dir("mistral3-mm")
    stored = load_file(str(Path(path) / "model.safetensors"))
    assert not torch.equal(stored[EMBED], stored[HEAD])
    says_tied = _variant(path, tmp_path / "says_tied", stored, tie_word_embeddings=True)
    no_head = _variant(
        path, tmp_path / "no_head", {k: v for k, v in stored.items() if k != HEAD}, tie_word_embeddings=True
    )
    equal_head = _variant(
        path, tmp_path / "equal_head", {**stored, HEAD: stored[EMBED].clone()}, tie_word_embeddings=True
    )
    prompts = mixed_prompts(4, [3, 17, 40])
    for folder, tied in ((says_tied, False), (no_head, True), (equal_head, True)):
        hf = _hf(folder)
        assert (hf.lm_head.weight is hf.model.language_model.embed_tokens.weight) == tied, folder.name
        got = _greedy(folder, prompts)
        assert got == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts], folder.name
        assert LLM(str(folder), num_kv_blocks=16).engine.model.tie_word_embeddings == tied
    # The untied head matters here: served tied, the same prompts decode otherwise.
    assert _greedy(says_tied, prompts) != _greedy(equal_head, prompts)


def test_the_released_3_1_config_reads_as_mistral_small_24bs_decoder() -> None:
    """mistralai/Mistral-Small-3.1-24B-Instruct-2503's config.json as released (transformers 4.50's
    layout: ``rope_theta`` at the text level, no top-level ``tie_word_embeddings``)."""
    from lorastar.models.layer_types import layer_windows
    from lorastar.models.mistral3 import _query_scale
    from lorastar.models.registry import model_class

    released = {
        "architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "image_token_index": 10,
        "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
        "torch_dtype": "bfloat16", "vision_feature_layer": -1,
        "text_config": {"head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 32768,
                        "max_position_embeddings": 131072, "model_type": "mistral", "num_attention_heads": 32,
                        "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                        "rope_theta": 1000000000.0, "sliding_window": None, "use_cache": True, "vocab_size": 131072},
        "vision_config": {"hidden_size": 1024, "model_type": "pixtral", "num_hidden_layers": 24},
    }  # fmt: skip
    cls = model_class(released)
    cfg = cls.text_config(released)
    assert cls.__name__ == "Mistral3ForConditionalGeneration"
    got = {k: cfg.get(k) for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                                   "hidden_size", "tie_word_embeddings", "torch_dtype", "eos_token_id")}  # fmt: skip
    assert got == {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 131072,
                   "hidden_size": 5120, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                   "eos_token_id": 2}  # fmt: skip
    assert cfg["rope_parameters"]["rope_theta"] == 1e9
    assert layer_windows(cfg) == [0] * 40  # no sliding window: every layer attends to the whole context
    # Ministral 3's text model: its YaRN and query-scaling defaults; another text model is refused.
    ministral = {**released, "text_config": {**released["text_config"], "model_type": "ministral3"}}
    assert _query_scale(cls.text_config(ministral)) == (0.1, 16384)  # Ministral3Config's defaults
    pixtral_text = {**released, "text_config": {**released["text_config"], "model_type": "llama"}}
    with pytest.raises(ValueError, match="'llama' text model is not supported"):
        cls.text_config(pixtral_text)


@pytest.mark.parametrize(
    ("targets", "vision"),
    [
        (
            ["q_proj", "o_proj", "down_proj", "linear_1"],
            True,
        ),  # q/o/down in both towers, linear_1 the projector's
        (r".*language_model.*\.(v_proj|gate_proj)", False),  # a regex on the multimodal model's paths
    ],
)
def test_adapters_of_the_multimodal_model_apply_as_peft_applies_them(
    tiny_model_dir, tmp_path, targets: list[str] | str, vision: bool
) -> None:  # noqa: ANN001
    path = tiny_model_dir("mistral3-mm")
    adapter = make_peft_adapter(
        path, tmp_path / "a", seed=5, targets=["unused"], map_targets=lambda b, n: targets
    )
    keys = load_file(str(Path(adapter) / "adapter_model.safetensors"))
    assert any("vision_tower" in k for k in keys) == vision
    assert any("multi_modal_projector" in k for k in keys) == vision
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


def test_an_adapter_of_the_projector_alone_is_refused(tiny_model_dir, tmp_path) -> None:  # noqa: ANN001
    path = tiny_model_dir("mistral3-mm")
    adapter = make_peft_adapter(
        path, tmp_path / "p", seed=6, targets=["linear_1", "linear_2"], map_targets=lambda b, n: n
    )
    llm = LLM(path, num_kv_blocks=32, max_loras=1, max_lora_rank=8)
    with pytest.raises(AdapterError, match="nothing applies to text"):
        llm.load_adapter("p", adapter)
    assert llm.list_adapters() == []


def test_ministral_3_decodes_as_transformers_past_the_original_context(tiny_model_dir) -> None:  # noqa: ANN001
    """Ministral 3's decoder (``text_config.model_type`` ministral3): YaRN and Llama 4's query scaling,
    which starts at the original context (16 positions here, 16k released): greedy tokens, and logits
    within 1e-4 relative at every decode step of a sequence ten original contexts long."""
    from tests.models.test_sliding_window import assert_decodes_as_hf

    path = tiny_model_dir("ministral3-mm")
    hf = _hf(path)
    assert hf.config.text_config.model_type == "ministral3"
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = mixed_prompts(13, [3, 40, 140])
    llm = LLM(path, num_kv_blocks=128, block_size=8, max_num_batched_tokens=32)
    assert all(
        a.q_position_scale == (0.1, 16) for a in llm.engine.model.modules() if hasattr(a, "q_position_scale")
    )
    assert_decodes_as_hf(hf, llm, prompts, sp)
