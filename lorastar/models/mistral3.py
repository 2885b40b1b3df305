"""Mistral Small 3.1 / 3.2 (24B, ``Mistral3ForConditionalGeneration``) served as text.

The checkpoint is a Mistral decoder beside a Pixtral vision tower and a projector; its ``text_config``
builds the decoder, the language model's tensors load under either naming transformers has written
(``checkpoint_keys.LLAVA_LAYOUT``), and the vision tower and projector are skipped, in the checkpoint
and in adapters. Text prompts get exactly the multimodal model's text output; images are refused by
the API (text content only).
"""

from __future__ import annotations

from typing import Any, ClassVar

from lorastar.checkpoint_keys import LLAVA_LAYOUT, KeyMap
from lorastar.models.llama import LlamaForCausalLM


class Mistral3ForConditionalGeneration(LlamaForCausalLM):
    """A Mistral 3 text-and-image checkpoint served as text (its decoder is Mistral's: GQA, RoPE, a
    sliding window only where ``text_config`` sets one; Small 3.1/3.2 set none).

    Adapters trained on the multimodal model (Unsloth's and PEFT's ``target_modules=["q_proj", ...]``
    wrap Pixtral's attention and MLP too, under the same names) apply to the language model; their
    vision-tower and projector tensors are skipped."""

    architectures: ClassVar[dict[str, str]] = {"Mistral3ForConditionalGeneration": "mistral3"}
    key_map: ClassVar[KeyMap] = LLAVA_LAYOUT
    # The projector's linears; Pixtral's own (q/k/v/o_proj, gate/up/down_proj) share the decoder's names.
    unserved_lora_modules: ClassVar[tuple[str, ...]] = ("linear_1", "linear_2", "merging_layer")

    @classmethod
    def text_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """``text_config`` completed with transformers' ``MistralConfig`` defaults, then the top
        level's own fields (``tie_word_embeddings`` where it is written, ``dtype``,
        ``quantization_config``) over it. A text tower other than Mistral's (Ministral 3's
        ``ministral3``: YaRN and a position-scaled attention) is refused, naming it."""
        from transformers import MistralConfig

        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("Mistral3ForConditionalGeneration: config.json has no text_config object")
        text_type = text.get("model_type", "mistral")
        if text_type != "mistral":
            raise ValueError(
                f"Mistral3ForConditionalGeneration with a {text_type!r} text model is not supported "
                "(served: Mistral Small 3.1 / 3.2, whose text model is 'mistral')"
            )
        full = MistralConfig(**text).to_dict()
        top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
        return {**full, **top}
