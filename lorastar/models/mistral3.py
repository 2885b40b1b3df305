"""Mistral 3: Mistral Small 3.1 / 3.2 (24B) and Ministral 3 (3B, 8B, 14B), served as text.

Both ship as ``Mistral3ForConditionalGeneration``: a decoder beside a Pixtral vision tower and a
projector. Its ``text_config`` builds the decoder, the language model's tensors load under either
naming transformers has written (``checkpoint_keys.LLAVA_LAYOUT``), and the vision tower and
projector are skipped, in the checkpoint and in adapters. Text prompts get exactly the multimodal
model's text output; images are refused by the API (text content only).

The decoders: Small 3.x's is Mistral's (``text_config.model_type`` ``"mistral"``); Ministral 3's
(``"ministral3"``, also ``Ministral3ForCausalLM`` on its own) is Mistral's with YaRN RoPE and Llama 4's
query scaling past the original context, ``q *= 1 + beta * ln(1 + floor(position / original))`` with
``beta = rope_parameters["llama_4_scaling_beta"]`` (1 below the original 16k positions).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from lorastar.checkpoint_keys import LLAVA_LAYOUT, KeyMap
from lorastar.layers.rotary import RotaryEmbedding
from lorastar.models.llama import LlamaForCausalLM, multimodal_text_config, transformers_defaults
from lorastar.quant.base import QuantConfig

# text_config.model_type -> the transformers config class whose defaults complete it
_TEXT_CONFIGS = {"mistral": "MistralConfig", "ministral3": "Ministral3Config"}


def _query_scale(cfg: dict[str, Any]) -> tuple[float, int] | None:
    """(beta, original context) of Llama 4's query scaling, or None where the config sets none."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    beta = params.get("llama_4_scaling_beta")
    if beta is None:
        return None
    return float(beta), int(params["original_max_position_embeddings"])


class Ministral3ForCausalLM(LlamaForCausalLM):
    """Ministral 3's decoder: Mistral's with YaRN and the position-scaled query."""

    architectures: ClassVar[dict[str, str]] = {"Ministral3ForCausalLM": "ministral3"}

    @classmethod
    def text_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """``config.json`` completed with transformers' ``Ministral3Config`` defaults (its YaRN and
        query-scaling parameters where the file has none)."""
        return {**transformers_defaults(cfg, "Ministral3Config"), **cfg}

    def make_layer(
        self,
        cfg: dict[str, Any],
        layer_idx: int,
        dtype: torch.dtype,
        quant: QuantConfig | None,
        rope: RotaryEmbedding,
        sliding_window: int,
    ) -> nn.Module:
        layer = super().make_layer(cfg, layer_idx, dtype, quant, rope, sliding_window)
        layer.self_attn.q_position_scale = _query_scale(cfg)
        return layer


class Mistral3ForConditionalGeneration(Ministral3ForCausalLM):
    """A Mistral 3 text-and-image checkpoint served as text (Small 3.1/3.2 set no sliding window and
    no query scaling; Ministral 3 sets the scaling).

    Adapters trained on the multimodal model (Unsloth's and PEFT's ``target_modules=["q_proj", ...]``
    wrap Pixtral's attention and MLP too, under the same names) apply to the language model; their
    vision-tower and projector tensors are skipped."""

    architectures: ClassVar[dict[str, str]] = {"Mistral3ForConditionalGeneration": "mistral3"}
    key_map: ClassVar[KeyMap] = LLAVA_LAYOUT
    # The projector's linears; Pixtral's own (q/k/v/o_proj, gate/up/down_proj) share the decoder's names.
    unserved_lora_modules: ClassVar[tuple[str, ...]] = ("linear_1", "linear_2", "merging_layer")

    @classmethod
    def text_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """``text_config`` completed with transformers' defaults for its decoder (``MistralConfig``,
        ``Ministral3Config``), then the top level's own fields (``tie_word_embeddings`` where it is
        written, ``dtype``, ``quantization_config``) over it. Another text model is refused, naming it."""
        text = cfg.get("text_config")
        text_type = text.get("model_type", "mistral") if isinstance(text, dict) else "mistral"
        if text_type not in _TEXT_CONFIGS:
            raise ValueError(
                f"Mistral3ForConditionalGeneration with a {text_type!r} text model is not supported "
                "(served: Mistral Small 3.1 / 3.2's 'mistral' and Ministral 3's 'ministral3')"
            )
        return multimodal_text_config(cfg, _TEXT_CONFIGS[text_type])
