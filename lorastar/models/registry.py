"""Which model class serves which HF architecture (``config.json``'s ``architectures``)."""

from __future__ import annotations

from typing import Any

from lorastar.models.gemma import Gemma3ForConditionalGeneration, GemmaForCausalLM
from lorastar.models.granite import GraniteForCausalLM
from lorastar.models.llama import LlamaForCausalLM
from lorastar.models.llama import check_architecture as _check
from lorastar.models.mistral3 import Ministral3ForCausalLM, Mistral3ForConditionalGeneration
from lorastar.models.olmo2 import Olmo2ForCausalLM
from lorastar.models.olmo3 import Olmo3ForCausalLM
from lorastar.models.smollm3 import SmolLM3ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    **dict.fromkeys(LlamaForCausalLM.architectures, LlamaForCausalLM),
    **dict.fromkeys(GemmaForCausalLM.architectures, GemmaForCausalLM),
    **dict.fromkeys(Gemma3ForConditionalGeneration.architectures, Gemma3ForConditionalGeneration),
    **dict.fromkeys(Mistral3ForConditionalGeneration.architectures, Mistral3ForConditionalGeneration),
    **dict.fromkeys(Ministral3ForCausalLM.architectures, Ministral3ForCausalLM),
    **dict.fromkeys(SmolLM3ForCausalLM.architectures, SmolLM3ForCausalLM),
    **dict.fromkeys(GraniteForCausalLM.architectures, GraniteForCausalLM),
    **dict.fromkeys(Olmo2ForCausalLM.architectures, Olmo2ForCausalLM),
    **dict.fromkeys(Olmo3ForCausalLM.architectures, Olmo3ForCausalLM),
}


SUPPORTED = {
    cls_name: cls.architectures[cls_name] for cls_name, cls in MODEL_CLASSES.items()
}  # HF class -> model_type


def check_architecture(hf_config: dict[str, Any]) -> str:
    """The config's first supported architecture name, or a ValueError listing what is supported."""
    return _check(hf_config, SUPPORTED)


def model_class(hf_config: dict[str, Any]) -> type[LlamaForCausalLM]:
    return MODEL_CLASSES[check_architecture(hf_config)]
