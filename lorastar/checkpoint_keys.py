"""How a checkpoint's tensor names (and its adapters' module paths) map onto the served model's.

A multimodal checkpoint served as text only (Gemma 3 4B-27B: ``Gemma3ForConditionalGeneration``;
Mistral Small 3.1/3.2: ``Mistral3ForConditionalGeneration``) keeps its language model under a prefix and carries parts the engine does not run (the vision tower,
the projector). The model class states the mapping once (``LlamaForCausalLM.key_map``); the weight
loader and the PEFT reader both apply it, so a checkpoint and the adapters trained on it agree.
Imports nothing from lorastar: models/ and adapters/ both read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KeyMap:
    """``renames``: (checkpoint prefix, served prefix) pairs, the first match applies;
    ``unserved``: prefixes of tensors that belong to parts not served (skipped, never an error)."""

    renames: tuple[tuple[str, str], ...] = ()
    unserved: tuple[str, ...] = ()

    def __call__(self, name: str) -> str | None:
        """``name`` as the served model calls it, or None for a tensor of an unserved part."""
        if self.unserved and name.startswith(self.unserved):
            return None
        for old, new in self.renames:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    def sources(self, served: str) -> tuple[str, ...]:
        """The names a checkpoint may give what the served model calls ``served`` (a prefix ending in
        ``.``): ``served`` itself, then each rename undone that maps back to it."""
        out = [served]
        for old, new in self.renames:
            if served.startswith(new):
                stored = old + served[len(new) :]
                if stored not in out and self(stored) == served:
                    out.append(stored)
        return tuple(out)


# transformers' LLaVA-style layout of a text-and-image model (Gemma 3, Mistral 3): the language model
# under ``language_model.model.*`` + ``language_model.lm_head`` (the released checkpoints' tensor names,
# which transformers 5 still writes) or ``model.language_model.*`` + ``lm_head`` (its module paths since
# 4.52, so PEFT's keys), beside a vision tower and a projector that a text server skips.
LLAVA_LAYOUT = KeyMap(
    renames=(
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ),
    unserved=(
        "vision_tower.",
        "multi_modal_projector.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
    ),
)
