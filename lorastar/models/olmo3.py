"""OLMo 3 (``Olmo3ForCausalLM``: AI2's fully open 7B and 32B, Base / Instruct / Think).

OLMo 2's layers (``models/olmo2.py``) with local and global layers: three of every four attend through
a sliding window (``layer_types``), and each layer type has its own RoPE (``rope_parameters`` nested
by layer type; the long-context YaRN applies to the global layers only), as Gemma 3 nests them.

transformers applies OLMo 3's cos/sin in fp32 without rounding them to the model's dtype first; here
they are rounded as for every other family, which changes nothing in fp32 and rounds q and k once more
in bf16 (near ties may differ there).
"""

from __future__ import annotations

from typing import Any, ClassVar

from lorastar.models.llama import transformers_defaults
from lorastar.models.olmo2 import Olmo2ForCausalLM


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    architectures: ClassVar[dict[str, str]] = {"Olmo3ForCausalLM": "olmo3"}
    rope_per_layer_type: ClassVar[bool] = True

    @classmethod
    def text_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """``config.json`` completed with transformers' ``Olmo3Config`` defaults: ``layer_types`` (three
        sliding layers in four), ``rope_parameters`` per layer type (base 500,000; a top-level
        ``rope_scaling`` goes to the global layers)."""
        full = transformers_defaults(cfg, "Olmo3Config")
        return {
            **cfg,
            **{k: full[k] for k in ("layer_types", "rope_parameters", "sliding_window")},
            "rope_scaling": None,
        }
