"""Config variants people fine-tune, per served family: a tiny random transformers model built with the
variant, saved, loaded by lorastar's loader, gives the same prompt logits as transformers' forward (or
is refused at load with a clear error). Covers RoPE scaling as hand-written ``rope_scaling`` (no
``original_max_position_embeddings``, or a top-level one that transformers prefers), Gemma 3's
ignored ``attn_logit_softcapping``, and the sliding-window, bias, head-size and soft-capping fields."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from lorastar.models.loader import load_model, read_hf_config
from tests.conftest import prefill_logits

BASE = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [1.0 + 0.9 * i for i in range(8)],
}


def _hand_written_rope(scaling: dict[str, Any], **top: Any) -> Callable[[dict[str, Any]], None]:
    """An edit of config.json: RoPE as 4.x-era model cards tell users to write it (``rope_theta`` and a
    ``rope_scaling`` object), plus top-level fields ``top``."""

    def edit(cfg: dict[str, Any]) -> None:
        cfg.pop("rope_parameters", None)
        cfg.update(rope_theta=10000.0, rope_scaling=scaling, **top)

    return edit


def _set_nested_original(n: int) -> Callable[[dict[str, Any]], None]:
    def edit(cfg: dict[str, Any]) -> None:
        cfg["rope_parameters"]["original_max_position_embeddings"] = n

    return edit


def _drop(field: str) -> Callable[[dict[str, Any]], None]:
    def edit(cfg: dict[str, Any]) -> None:
        cfg.pop(field)

    return edit


# id -> (transformers family, config kwargs, config.json edit, prompt length, engine max positions)
VARIANTS: dict[str, tuple[str, dict[str, Any], Callable[[dict[str, Any]], None] | None, int, int]] = {
    # yarn / llama3 without original_max_position_embeddings: transformers takes max_position_embeddings
    "llama-yarn-no-original": ("Llama", {}, _hand_written_rope({"type": "yarn", "factor": 4.0},
                                                               max_position_embeddings=32), 60, 256),
    "llama-llama3-no-original": ("Llama", {}, _hand_written_rope(
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        max_position_embeddings=32), 60, 256),
    # a top-level original_max_position_embeddings wins over rope_scaling's own (transformers)
    "llama-yarn-top-level-original": ("Llama", {}, _hand_written_rope(
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        original_max_position_embeddings=16), 60, 256),
    "phi3-longrope-top-level-original": ("Phi3", {"original_max_position_embeddings": 64,
                                                  "rope_parameters": LONGROPE}, _set_nested_original(32), 48, 48),
    # Gemma 3's attention has no logit soft-capping (the field is read by Gemma 2 only); final one applies
    "gemma3-attn-softcap-ignored": ("Gemma3Text", {"head_dim": 16, "sliding_window": 8,
                                                   "attn_logit_softcapping": 5.0,
                                                   "final_logit_softcapping": 3.0}, None, 40, 256),
    "gemma2-softcaps-query-scalar": ("Gemma2", {"head_dim": 16, "sliding_window": 8, "attn_logit_softcapping": 5.0,
                                                "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 24},
                                     None, 40, 256),
    "gemma3-old-rope-fields": ("Gemma3Text", {"head_dim": 16, "sliding_window": 8}, _hand_written_rope(
        {"rope_type": "linear", "factor": 8.0}, rope_local_base_freq=500.0), 40, 256),
    # Qwen2/Qwen3: a sliding window only with use_sliding_window, from layer max_window_layers on
    "qwen2-window-off": ("Qwen2", {"sliding_window": 8, "use_sliding_window": False, "max_window_layers": 0},
                         None, 40, 256),
    "qwen3-window-from-layer-1": ("Qwen3", {"head_dim": 16, "sliding_window": 8, "use_sliding_window": True,
                                            "max_window_layers": 1, "attention_bias": True}, None, 40, 256),
    "llama-head-dim-biases-tanh": ("Llama", {"head_dim": 32, "attention_bias": True, "mlp_bias": True,
                                             "hidden_act": "gelu_pytorch_tanh", "rms_norm_eps": 1e-2},
                                   None, 40, 256),
    "phi3-window-partial-rotary": ("Phi3", {"sliding_window": 8, "partial_rotary_factor": 0.5}, None, 40, 256),
    "granite-head-dim-biases": ("Granite", {"head_dim": 32, "attention_bias": True, "mlp_bias": True,
                                            "attention_multiplier": 0.1, "logits_scaling": 4.0}, None, 40, 256),
    # Llama, Granite and OLMo 2 attend fully whatever sliding_window says (transformers and vLLM read it
    # only through layer_types); Mistral and Phi-3 window every layer
    "llama-window-ignored": ("Llama", {"sliding_window": 8}, None, 40, 256),
    "granite-window-ignored": ("Granite", {"sliding_window": 8}, None, 40, 256),
    "olmo2-window-ignored": ("Olmo2", {"sliding_window": 8}, None, 40, 256),
    "mistral-window": ("Mistral", {"sliding_window": 8}, None, 40, 256),
    # a config.json without rms_norm_eps: each family's transformers default (OLMo 2, Phi-3: 1e-5)
    "olmo2-eps-omitted": ("Olmo2", {}, _drop("rms_norm_eps"), 40, 256),
    "phi3-eps-omitted": ("Phi3", {}, _drop("rms_norm_eps"), 40, 256),
    "llama-eps-omitted": ("Llama", {}, _drop("rms_norm_eps"), 40, 256),
}  # fmt: skip


def _save(tmp_path: Path, family: str, kwargs: dict[str, Any], edit: Callable[[dict[str, Any]], None] | None):
    """A tiny random ``family`` model saved to ``tmp_path`` (norms, biases and q/k scaled to matter), with
    ``edit`` applied to its config.json; returns transformers' model as it reads the folder back."""
    cls = getattr(transformers, f"{family.removesuffix('Text')}ForCausalLM")  # Gemma3TextConfig's
    cfg = getattr(transformers, f"{family}Config")(**{**BASE, **kwargs})
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(0.0 if family.startswith("Gemma") else 1.0, 0.3)
            elif n.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "q_proj" in n or "k_proj" in n or "qkv_proj" in n:
                p.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path)
    if edit is not None:
        path = tmp_path / "config.json"
        raw = json.loads(path.read_text())
        edit(raw)
        path.write_text(json.dumps(raw))
    return cls.from_pretrained(tmp_path, dtype=torch.float32).eval()


def _lorastar_logits(path: Path, ids: list[int], max_positions: int) -> torch.Tensor:
    cfg = read_hf_config(path)
    model, _ = load_model(
        path, cfg, dtype=torch.float32, device=torch.device("cpu"), quant=None, max_positions=max_positions
    )
    return prefill_logits(model, ids).float()  # [T, vocab]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variant_logits_equal_transformers(tmp_path: Path, variant: str) -> None:
    family, kwargs, edit, length, max_positions = VARIANTS[variant]
    hf = _save(tmp_path, family, kwargs, edit)
    ids = torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0].float()
    got = _lorastar_logits(tmp_path, ids, max_positions)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize(
    ("family", "kwargs", "message"),
    [
        ("Llama", {"rope_parameters": {"rope_type": "proportional", "factor": 2.0, "rope_theta": 10000.0}},
         "unsupported rope scaling type 'proportional'"),
        ("Llama", {"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ("Gemma2", {"head_dim": 16, "hidden_activation": "gelu"}, "unsupported hidden_act 'gelu'"),
    ],
)  # fmt: skip
def test_unserved_variants_are_refused_at_load(
    tmp_path: Path, family: str, kwargs: dict[str, Any], message: str
) -> None:
    _save(tmp_path, family, kwargs, None)
    with pytest.raises(ValueError, match=message):
        _lorastar_logits(tmp_path, [5, 6, 7], 64)
