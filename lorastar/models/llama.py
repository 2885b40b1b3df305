"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3) over the paged KV cache.

One forward runs a flat batch of tokens (prefill chunks and decodes together). q/k/v and
gate/up are fused linears whose slices carry LoRA; every linear carries a quant method.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from lorastar.checkpoint_keys import KeyMap
from lorastar.forward_context import ForwardContext
from lorastar.layers.activation import GATED_ACTIVATIONS, NATIVE_CPU_ACTIVATIONS
from lorastar.layers.attention import attention_forward
from lorastar.layers.embedding import EmbeddingMethod, UnquantizedEmbeddingMethod, VocabEmbedding
from lorastar.layers.linear import Linear, UnquantizedLinearMethod
from lorastar.layers.norm import RMSNorm
from lorastar.layers.rotary import RotaryEmbedding
from lorastar.models.layer_types import layer_windows
from lorastar.quant.base import QuantConfig

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",  # Phi-3 / 3.5 / Phi-4-mini: fused qkv_proj / gate_up_proj checkpoints
}
# family -> the transformers config class whose defaults complete a config.json (text_config)
_DEFAULTS_FROM = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                  "qwen3": "Qwen3Config", "phi3": "Phi3Config", "granite": "GraniteConfig",
                  "olmo2": "Olmo2Config"}  # fmt: skip
# Families whose checkpoints (and so their PEFT adapters) store the fused modules themselves.
FUSED_CHECKPOINT_FAMILIES = ("phi3",)


def layer_type_rope_config(cfg: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """The config one layer type's RoPE reads: ``rope_parameters`` nested by layer type (transformers
    5 writes them so for Gemma 3 and OLMo 3), else the model's one set."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        # Nested: the layer type's own original context only (transformers ignores the top level's).
        nested = {"rope_parameters": params[layer_type], "rope_scaling": None}
        return {**cfg, **nested, "original_max_position_embeddings": None}
    return cfg


def transformers_defaults(cfg: dict[str, Any], config_class: str) -> dict[str, Any]:
    """``cfg`` as transformers' ``config_class`` completes it (``to_dict()``): the fields a file omits,
    and those it derives (layer types, RoPE parameters), as transformers fills them."""
    import transformers

    fields = {k: v for k, v in cfg.items() if k != "quantization_config"}  # read as it is, by the caller
    for key in ("rope_scaling", "rope_parameters"):
        rope = fields.get(key)
        if isinstance(rope, dict) and "su" in (rope.get("rope_type"), rope.get("type")):
            # Early Phi-3 checkpoints' name for longrope (vLLM renames it): transformers 5 renames it only
            # after completing the parameters, without original_max_position_embeddings, then refuses them.
            fields[key] = {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "longrope"}
    return getattr(transformers, config_class)(**fields).to_dict()


def multimodal_text_config(cfg: dict[str, Any], config_class: str) -> dict[str, Any]:
    """A text-and-image config's decoder: ``text_config`` completed with ``config_class``'s defaults,
    then the top level's own fields over it (``eos_token_id``, ``tie_word_embeddings`` where written,
    ``dtype``, ``quantization_config``)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{cfg.get('architectures', ['?'])[0]}: config.json has no text_config object")
    top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    return {**transformers_defaults(text, config_class), **top}


def check_architecture(hf_config: dict[str, Any], supported: dict[str, str] = SUPPORTED_ARCHITECTURES) -> str:
    """The config's first architecture in ``supported`` (HF class name -> model_type); a config saved
    without ``architectures`` is matched by its ``model_type``. A decoder saved as its backbone
    (``Qwen3Model``: sentence-transformers' save of an embedding model) is served by its
    ``*ForCausalLM`` (the loader reads its tensors without the ``model.`` prefix)."""
    archs = hf_config.get("architectures")
    if not archs:
        model_type = hf_config.get("model_type", "?")
        by_type = {family: arch for arch, family in supported.items()}
        if model_type in by_type:
            return by_type[model_type]
        archs = [model_type]
    for a in archs:
        if a in supported:
            return a
        if (
            isinstance(a, str)
            and a.endswith("Model")
            and (causal := a[: -len("Model")] + "ForCausalLM") in supported
            and supported[causal] == hf_config.get("model_type")  # (Gemma3Model: the multimodal one)
        ):
            return causal
    raise ValueError(f"unsupported architecture {archs[0]!r}; supported: {', '.join(sorted(supported))}")


def _linear_method(quant: QuantConfig | None, prefix: str):  # noqa: ANN202
    return quant.get_linear_method(prefix) if quant is not None else None


class Attention(nn.Module):
    def __init__(
        self,
        cfg: dict[str, Any],
        layer_idx: int,
        dtype: torch.dtype,
        quant: QuantConfig | None,
        rope: RotaryEmbedding,
        sliding_window: int = 0,
    ) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.sliding_window = sliding_window  # keys each query sees (0: all)
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or hidden // self.num_heads
        self.layer_idx = layer_idx
        self.scale = self.head_dim**-0.5
        bias = bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2"
        prefix = f"model.layers.{layer_idx}.self_attn"
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.qkv_proj = Linear(
            hidden, [q_size, kv_size, kv_size], bias=bias, prefix=f"{prefix}.qkv_proj",
            slice_names=LlamaForCausalLM.packed_modules_mapping["qkv_proj"], params_dtype=dtype,
            quant_method=_linear_method(quant, f"{prefix}.qkv_proj"),
        )  # fmt: skip
        o_bias = bool(cfg.get("attention_bias", False)) and cfg.get("model_type") != "qwen2"
        self.o_proj = Linear(
            q_size, [hidden], bias=o_bias, prefix=f"{prefix}.o_proj", slice_names=["o_proj"],
            params_dtype=dtype, quant_method=_linear_method(quant, f"{prefix}.o_proj"),
        )  # fmt: skip
        self.rope = rope
        self.use_rope = True  # False: a NoPE layer (SmolLM3's every fourth), q and k as projected
        # Ministral 3's (Llama 4's) query scaling past the original context: (beta, original length),
        # q *= 1 + beta * ln(1 + floor(position / original)); None: none.
        self.q_position_scale: tuple[float, int] | None = None
        self.softcap = 0.0  # attention-logit soft-capping (Gemma 2); 0: none
        # Qwen3: RMSNorm over each head of q and k, before RoPE.
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.get("model_type") == "qwen3":
            eps = cfg.get("rms_norm_eps", 1e-6)
            self.q_norm = RMSNorm(self.head_dim, eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, eps, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        qkv = self.qkv_proj(x, ctx)  # [T, q + 2 kv]
        if (
            self.q_norm is None
            and self.use_rope
            and self.q_position_scale is None
            and self.rope.rotary_dim == self.head_dim
        ):
            # q and k heads rotated in one pass over a view of qkv
            qk = qkv[:, : self.q_size + self.kv_size].view(
                -1, self.num_heads + self.num_kv_heads, self.head_dim
            )
            qk = self.rope.rotate(positions, qk, ctx)  # [T, Hq + Hkv, D]
            v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
            o = attention_forward(
                qk[:, : self.num_heads], qk[:, self.num_heads :], v, ctx, self.layer_idx, self.scale,
                sliding_window=self.sliding_window, softcap=self.softcap,
            )  # fmt: skip
            return self.o_proj(o.reshape(-1, self.q_size), ctx)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = self.rope(positions, q, k, ctx)
        if self.q_position_scale is not None:
            beta, orig = self.q_position_scale
            scale = 1 + beta * torch.log(1 + torch.floor(positions / orig))  # [T] fp32, as transformers
            q = q * scale.to(q.dtype)[:, None, None]
        o = attention_forward(
            q, k, v, ctx, self.layer_idx, self.scale, sliding_window=self.sliding_window, softcap=self.softcap
        )  # [T, Hq, D]
        return self.o_proj(o.reshape(-1, self.q_size), ctx)


class MLP(nn.Module):
    def __init__(
        self, cfg: dict[str, Any], layer_idx: int, dtype: torch.dtype, quant: QuantConfig | None
    ) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        prefix = f"model.layers.{layer_idx}.mlp"
        act = cfg.get("hidden_act", "silu")
        if act not in GATED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {', '.join(GATED_ACTIVATIONS)}")
        self.act_and_mul = GATED_ACTIVATIONS[act]
        self.act = act
        bias = bool(cfg.get("mlp_bias", False))
        self.gate_up_proj = Linear(
            hidden, [inter, inter], bias=bias, prefix=f"{prefix}.gate_up_proj",
            slice_names=LlamaForCausalLM.packed_modules_mapping["gate_up_proj"], params_dtype=dtype,
            quant_method=_linear_method(quant, f"{prefix}.gate_up_proj"),
        )  # fmt: skip
        self.down_proj = Linear(
            inter, [hidden], bias=bias, prefix=f"{prefix}.down_proj", slice_names=["down_proj"],
            params_dtype=dtype, quant_method=_linear_method(quant, f"{prefix}.down_proj"),
        )  # fmt: skip

    def use_native_cpu_ops(self) -> None:
        self.act_and_mul = NATIVE_CPU_ACTIVATIONS.get(self.act, self.act_and_mul)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, ctx)  # [T, 2 * inter]
        return self.down_proj(self.act_and_mul(gate_up), ctx)  # [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: dict[str, Any],
        layer_idx: int,
        dtype: torch.dtype,
        quant: QuantConfig | None,
        rope: RotaryEmbedding,
        sliding_window: int = 0,
    ) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps, dtype)
        self.self_attn = Attention(cfg, layer_idx, dtype, quant, rope, sliding_window)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps, dtype)
        self.mlp = MLP(cfg, layer_idx, dtype, quant)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, h = self.post_attention_layernorm.add_forward(
            x, self.self_attn(positions, self.input_layernorm(x), ctx)
        )
        return x + self.mlp(h, ctx)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 decoder. ``forward`` returns hidden states ``[T, hidden]``;
    ``compute_logits`` projects only the rows that are sampled.

    ``packed_modules_mapping`` (fused layer -> the checkpoint / PEFT modules it is made of, in slice
    order) and ``supported_lora_modules`` are the one statement of the model's structure: the layers'
    slice names, the loader's routing and the quant configs' skip lists all come from them."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    supported_lora_modules: ClassVar[list[str]] = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    architectures: ClassVar[dict[str, str]] = SUPPORTED_ARCHITECTURES  # HF class name -> family
    # Checkpoint tensor names -> ours, applied by the loader and to adapters' module paths (identity
    # here; multimodal checkpoints served as text rename their language model and skip the rest).
    key_map: ClassVar[KeyMap] = KeyMap()
    # LoRA targets that exist only in the unserved parts (their tensors are skipped with them).
    unserved_lora_modules: ClassVar[tuple[str, ...]] = ()
    # A RoPE per layer type (Gemma 2/3, OLMo 3): each layer gets its type's table (``rope_config``)
    # and reads it itself, no step-wide cos/sin.
    rope_per_layer_type: ClassVar[bool] = False
    # The decoder layer ``make_layer`` builds: a family with another layer shape names its class
    # here (same constructor); one that adjusts the built layer overrides ``make_layer``.
    layer_cls: ClassVar[type[nn.Module]] = DecoderLayer

    @classmethod
    def text_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """The decoder's config: ``config.json`` with the fields it omits filled from the family's
        transformers config class, as transformers and vLLM read it (OLMo 2's and Phi-3's
        ``rms_norm_eps`` default to 1e-5, not Llama's 1e-6). A family without a class here (its
        subclass completes its own) is taken as written."""
        name = _DEFAULTS_FROM.get(cls.architectures.get(check_architecture(cfg, cls.architectures), ""))
        if name is None:
            return cfg
        return {**transformers_defaults(cfg, name), **cfg}

    def __init__(
        self,
        cfg: dict[str, Any],
        dtype: torch.dtype,
        quant: QuantConfig | None,
        max_positions: int,
        embedding_method: Callable[[], EmbeddingMethod] | None = None,
    ) -> None:
        """``embedding_method``: the storage of the embedding and lm_head tables (one instance per
        table; ``quant/embedding_int8.py``); None keeps them as loaded."""
        super().__init__()
        self.config = cfg
        self.architecture = check_architecture(cfg, self.architectures)
        # Adapters target the fused qkv_proj / gate_up_proj, not their parts (adapters/peft.py ModelSpec).
        self.checkpoint_fused = self.architectures[self.architecture] in FUSED_CHECKPOINT_FAMILIES
        if quant is not None:
            quant.packed_modules_mapping = self.packed_modules_mapping
            quant.key_map = self.key_map
        hidden = cfg["hidden_size"]
        self.vocab_size = cfg["vocab_size"]
        self.num_layers = cfg["num_hidden_layers"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or hidden // self.num_heads
        table = embedding_method or UnquantizedEmbeddingMethod
        self.embed_tokens = VocabEmbedding(self.vocab_size, hidden, dtype, table())
        self.layer_windows = layer_windows(cfg)  # per layer: sliding window (0: full attention)
        if self.rope_per_layer_type:
            types = cfg.get("layer_types") or [
                "sliding_attention" if w > 0 else "full_attention" for w in self.layer_windows
            ]
            self.ropes = nn.ModuleDict(
                {t: RotaryEmbedding(self.rope_config(cfg, t), self.head_dim, max_positions)
                 for t in sorted({"full_attention", *types})}
            )  # fmt: skip
            self.rope = self.ropes["full_attention"]
            layer_ropes = [self.ropes[t] for t in types]
        else:
            self.rope = self.make_rope(cfg, max_positions)
            layer_ropes = [self.rope] * self.num_layers
        self.layers = nn.ModuleList(
            self.make_layer(cfg, i, dtype, quant, layer_ropes[i], self.layer_windows[i])
            for i in range(self.num_layers)
        )
        self.norm = self.make_norm(hidden, cfg.get("rms_norm_eps", 1e-6), dtype)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        # Tied: the one table serves both (nn.Module dedups it in parameters() and state loading).
        self.lm_head = (
            self.embed_tokens
            if self.tie_word_embeddings
            else VocabEmbedding(self.vocab_size, hidden, dtype, table())
        )

    def make_layer(
        self,
        cfg: dict[str, Any],
        layer_idx: int,
        dtype: torch.dtype,
        quant: QuantConfig | None,
        rope: RotaryEmbedding,
        sliding_window: int,
    ) -> nn.Module:
        """Layer ``layer_idx``: ``layer_cls`` built from these arguments."""
        return self.layer_cls(cfg, layer_idx, dtype, quant, rope, sliding_window)

    def make_rope(self, cfg: dict[str, Any], max_positions: int) -> RotaryEmbedding:
        return RotaryEmbedding(cfg, self.head_dim, max_positions)

    def rope_config(self, cfg: dict[str, Any], layer_type: str) -> dict[str, Any]:
        """The config one layer type's RoPE reads (``rope_per_layer_type``)."""
        return layer_type_rope_config(cfg, layer_type)

    def make_norm(self, size: int, eps: float, dtype: torch.dtype) -> nn.Module:
        return RMSNorm(size, eps, dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings ``[T, hidden]`` (families that scale them override this)."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed(input_ids)  # [T, hidden]
        if self.rope_per_layer_type:
            ctx.attn.rope_cos = ctx.attn.rope_sin = None  # each layer reads its own table
        else:
            ctx.attn.rope_cos, ctx.attn.rope_sin = self.rope.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(positions, x, ctx)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)  # [rows, vocab]

    def head_weight(self) -> torch.Tensor | None:
        """The lm_head's float weight ``[vocab, hidden]`` (the embedding table when tied), or None
        (an int8 table)."""
        return self.lm_head.method.float_weight(self.lm_head)

    def pack_for_cpu(self) -> int:
        """Prepack every dense CPU linear and the lm_head for oneDNN (``layers/cpu_gemm.py``); a tied
        head gets its own packed copy (the embedding lookup keeps the table). Returns linears packed."""
        n = 0
        for lin in self.linears().values():
            if isinstance(lin.quant_method, UnquantizedLinearMethod):
                n += lin.quant_method.pack_for_cpu(lin)
        head = self.lm_head
        if isinstance(head.method, UnquantizedEmbeddingMethod):
            head.method.pack_for_cpu(head, keep_table=self.tie_word_embeddings)
        return n

    def use_native_cpu_ops(self) -> int:
        """Route fp32 CPU norms, the gated activation and rotary through the C++ ops
        (``kernels/cpu_native.py``, loaded by the caller): every module with ``use_native_cpu_ops``.
        Same semantics to a few ulp; each module keeps torch's form for inputs the op does not take.
        Returns the modules switched."""
        mods = [m for m in self.modules() if m is not self and hasattr(m, "use_native_cpu_ops")]
        for m in mods:
            m.use_native_cpu_ops()
        return len(mods)

    def linears(self) -> dict[str, Linear]:
        return {m.prefix: m for m in self.modules() if isinstance(m, Linear)}
