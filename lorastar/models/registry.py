"""Which model class serves which HF architecture (``config.json``'s ``architectures``)."""

from __future__ import annotations

from typing import Any

from lorastar.models.gemma import GemmaForCausalLM
from lorastar.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    **dict.fromkeys(LlamaForCausalLM.architectures, LlamaForCausalLM),
    **dict.fromkeys(GemmaForCausalLM.architectures, GemmaForCausalLM),
}


def check_architecture(hf_config: dict[str, Any]) -> str:
    """The config's first supported architecture name, or a ValueError listing what is supported."""
    archs = hf_config.get("architectures") or [hf_config.get("model_type", "?")]
    for a in archs:
        if a in MODEL_CLASSES:
            return a
    raise ValueError(f"unsupported architecture {archs[0]!r}; supported: {', '.join(sorted(MODEL_CLASSES))}")


def model_class(hf_config: dict[str, Any]) -> type[LlamaForCausalLM]:
    return MODEL_CLASSES[check_architecture(hf_config)]
