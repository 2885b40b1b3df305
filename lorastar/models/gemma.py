"""Gemma 2 and Gemma 3 (text) decoders, assembled from the Llama family's layers.

What differs from Llama (transformers' Gemma2/Gemma3 modeling is the reference):
* RMSNorm stores ``w - 1`` and multiplies in fp32 (``GemmaRMSNorm``); four norms per layer (before and
  after attention, before and after the MLP);
* token embeddings scaled by ``sqrt(hidden)`` (cast to the weight dtype first, as transformers does);
* GeGLU MLP (tanh-approximated GELU); softmax scale ``query_pre_attn_scalar ** -0.5``;
* alternating local (sliding-window) and global layers (``models/layer_types.py``);
* Gemma 2: attention-logit and final-logit soft-capping ``c * tanh(x / c)`` (Gemma 3: final only);
* Gemma 3: per-head q/k norms (Gemma style) and a RoPE base per layer type (local 10k, global 1M,
  the global one possibly linearly scaled).

Gemma 3 4B-27B ship as ``Gemma3ForConditionalGeneration`` (text and images): served here as text
only, the language model is the Gemma 3 decoder above and the vision tower and projector are not
loaded (``Gemma3ForConditionalGeneration``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from lorastar.checkpoint_keys import LLAVA_LAYOUT, KeyMap
from lorastar.forward_context import ForwardContext
from lorastar.layers.embedding import EmbeddingMethod
from lorastar.layers.norm import GemmaRMSNorm
from lorastar.layers.rotary import RotaryEmbedding
from lorastar.models.llama import (
    MLP,
    Attention,
    LlamaForCausalLM,
    layer_type_rope_config,
    multimodal_text_config,
    transformers_defaults,
)
from lorastar.quant.base import QuantConfig

GEMMA_ARCHITECTURES = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"}
# config.json's model_type -> the transformers config class whose defaults complete it
_CONFIG_CLASSES = {"gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig", "gemma3": "Gemma3TextConfig"}


def _rope_config(cfg: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """The config one layer type's RoPE reads: Gemma 3 nests ``rope_parameters`` by layer type
    (transformers 5) or keeps the local base in ``rope_local_base_freq`` (older configs)."""
    params = cfg.get("rope_parameters")
    nested = isinstance(params, dict) and layer_type in params
    if (
        not nested
        and cfg.get("model_type") in ("gemma3", "gemma3_text")
        and layer_type == "sliding_attention"
    ):
        theta = float(cfg.get("rope_local_base_freq", 10000.0))
        return {**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "rope_scaling": None}
    return layer_type_rope_config(cfg, layer_type)


class GemmaAttention(Attention):
    def __init__(
        self,
        cfg: dict[str, Any],
        layer_idx: int,
        dtype: torch.dtype,
        quant: QuantConfig | None,
        rope: RotaryEmbedding,
        sliding_window: int,
    ) -> None:
        super().__init__(cfg, layer_idx, dtype, quant, rope, sliding_window)
        self.scale = float(cfg.get("query_pre_attn_scalar") or self.head_dim) ** -0.5
        # Gemma 2 only: Gemma 3's attention ignores attn_logit_softcapping (transformers, vLLM).
        if cfg.get("model_type") == "gemma2":
            self.softcap = float(cfg.get("attn_logit_softcapping") or 0.0)
        if cfg.get("model_type") in ("gemma3", "gemma3_text"):
            eps = cfg.get("rms_norm_eps", 1e-6)
            self.q_norm = GemmaRMSNorm(self.head_dim, eps, dtype)
            self.k_norm = GemmaRMSNorm(self.head_dim, eps, dtype)


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: dict[str, Any],
        layer_idx: int,
        dtype: torch.dtype,
        quant: QuantConfig | None,
        rope: RotaryEmbedding,
        sliding_window: int,
    ) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.self_attn = GemmaAttention(cfg, layer_idx, dtype, quant, rope, sliding_window)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        self.mlp = MLP({**cfg, "hidden_act": act}, layer_idx, dtype, quant)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), ctx))


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text decoder: the Llama model with Gemma's layers, norms, embedding scale,
    per-layer-type RoPE and final-logit soft-capping. Same checkpoint and LoRA module names."""

    architectures: ClassVar[dict[str, str]] = GEMMA_ARCHITECTURES
    rope_per_layer_type: ClassVar[bool] = True
    layer_cls: ClassVar[type[nn.Module]] = GemmaDecoderLayer

    def __init__(
        self,
        cfg: dict[str, Any],
        dtype: torch.dtype,
        quant: QuantConfig | None,
        max_positions: int,
        embedding_method: Callable[[], EmbeddingMethod] | None = None,
    ) -> None:
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention (embedding models) is not supported")
        super().__init__(cfg, dtype, quant, max_positions, embedding_method)
        self.final_softcap = float(cfg.get("final_logit_softcapping") or 0.0)

    @classmethod
    def text_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """``config.json`` completed with transformers' ``Gemma2Config`` / ``Gemma3TextConfig``
        defaults. transformers 4.x wrote no field equal to its base class's default, so Google's Gemma 2
        and Gemma 3 (1B, 270M) configs omit ``tie_word_embeddings`` (tied, and no ``lm_head`` stored),
        which the Llama default (untied) would read as a missing ``lm_head``."""
        name = _CONFIG_CLASSES.get(cfg.get("model_type", ""))
        return cfg if name is None else {**transformers_defaults(cfg, name), **cfg}

    def rope_config(self, cfg: dict[str, Any], layer_type: str) -> dict[str, Any]:
        return _rope_config(cfg, layer_type)

    def make_norm(self, size: int, eps: float, dtype: torch.dtype) -> nn.Module:
        return GemmaRMSNorm(size, eps, dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        return x * torch.tensor(self.config["hidden_size"] ** 0.5, dtype=x.dtype)  # as transformers rounds it

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)  # [rows, vocab]
        if self.final_softcap > 0:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma3ForConditionalGeneration(GemmaForCausalLM):
    """A Gemma 3 text-and-image checkpoint (4B, 12B, 27B and their fine-tunes) served as text: its
    ``text_config`` builds the Gemma 3 decoder, the language model's tensors load under either
    naming transformers has written (``language_model.model.*``, and ``model.language_model.*``
    with a top-level ``lm_head``), and the vision tower and projector are skipped, in the checkpoint
    and in adapters (LoRA on SigLIP's ``out_proj``/``fc1``/``fc2`` or its q/k/v changes only how
    images are read). Text prompts get exactly the multimodal model's text output; images are refused
    by the API (text content only)."""

    architectures: ClassVar[dict[str, str]] = {"Gemma3ForConditionalGeneration": "gemma3"}
    key_map: ClassVar[KeyMap] = LLAVA_LAYOUT
    unserved_lora_modules: ClassVar[tuple[str, ...]] = ("out_proj", "fc1", "fc2")

    @classmethod
    def text_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """``text_config`` completed with transformers' ``Gemma3TextConfig`` defaults (the released
        configs list only what differs from them: 4B's omits heads, head size, vocabulary, RoPE bases),
        then the top level's own fields (``eos_token_id``, ``tie_word_embeddings``, ``dtype``,
        ``quantization_config``) over it."""
        return multimodal_text_config(cfg, "Gemma3TextConfig")
