"""The int4 / FP8 loaders on every family's module names.

Quantized checkpoints of Mistral, Qwen3 and Gemma name their linears as Llama does; what differs is
everything around them (q/k norms, Gemma's norms and soft-caps, sliding windows). Each real fixture
(made by AutoAWQ / gptqmodel / llm-compressor, see scripts/make_quant_fixtures.py) is transplanted into
a tiny random model of each family with the fixture's shapes: the quantized tensors keep their names,
the family's other tensors come from transformers. Reference: transformers' model of that family with
each linear set to the fixture's dequantized weight, read from lorastar's Llama on the fixture (which
``test_quant_e2e`` checks against the quantization tools' own loaders).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quant_fixtures import checkpoint, present, read_config
from safetensors.torch import save_file
from test_quant_e2e import FP8_TOL, INT4_TOL, _forward_logits, _load

FAMILIES = (
    "mistral",
    "qwen3",
    "gemma2",
    "gemma3",
    "gemma3-mm",
    "mistral3-mm",
    "smollm3",
    "granite",
    "olmo2",
    "olmo3",
    "phi3",
)
# Gemma 3 4B-27B (Gemma3ForConditionalGeneration): the language model's tensors sit under this prefix
# (transformers >= 4.52's naming), beside a vision tower the loader skips.
_MM_PREFIX = "model.language_model."
# Phi-3 checkpoints store q/k/v and gate/up fused: the fixture's tensors are concatenated along their
# output dimension (dim 1 for AWQ/GPTQ's packed qweight/qzeros/scales, 0 for FP8 weight and scales).
# GPTQ with act-order has one g_idx per module, which a fused module cannot hold: gptq_sym instead.
# compressed-tensors' pack-quantized tensors are [out, ...] (zero points packed along out): dim 0.
_FUSE = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _fuse(tensors: dict[str, torch.Tensor], int4: bool) -> dict[str, torch.Tensor]:
    out = dict(tensors)
    for key in list(tensors):
        for fused, parts in _FUSE.items():
            block, _, rest = key.partition(f".{parts[0]}.")
            if not rest:
                block, _, rest = key.partition(f".{parts[0]}")
                if rest or not key.endswith(parts[0]):
                    continue
            names = [f"{block}.{p}.{rest}" if rest else f"{block}.{p}" for p in parts]
            pieces = [out.pop(n) for n in names]
            new = f"{block}.{fused}.{rest}" if rest else f"{block}.{fused}"
            if rest == "g_idx":
                assert all(torch.equal(pieces[0], x) for x in pieces)
                out[new] = pieces[0]
            elif rest == "weight_shape":  # compressed-tensors: the fused [out, in]
                assert all(x[1] == pieces[0][1] for x in pieces)
                out[new] = torch.stack([sum(x[0] for x in pieces), pieces[0][1]])
            elif rest in ("weight_packed", "weight_scale", "weight_zero_point"):
                # compressed-tensors' [out, ...] tensors (zero points packed 8 or 4 rows a word: each
                # part's out a multiple of it)
                if rest == "weight_zero_point":
                    for part, z in zip(parts, pieces):
                        shape = tensors[f"{block}.{part}.weight_shape"]
                        per_word = int(shape[1]) // tensors[f"{block}.{part}.weight_packed"].shape[1]
                        assert int(shape[0]) == z.shape[0] * per_word
                out[new] = torch.cat(pieces, dim=0)
            else:
                out[new] = torch.cat(pieces, dim=1 if int4 else 0)
    return out


def _hf_family(family: str, fx: dict) -> torch.nn.Module:
    import transformers as tf

    shapes = {
        k: fx[k]
        for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "num_hidden_layers", "vocab_size", "max_position_embeddings")
    }  # fmt: skip
    shapes["tie_word_embeddings"] = fx.get("tie_word_embeddings", False)
    torch.manual_seed(0)
    if family == "phi3":
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**shapes, pad_token_id=0))
    elif family == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**shapes, sliding_window=16))
    elif family == "granite":  # its four multipliers
        model = tf.GraniteForCausalLM(
            tf.GraniteConfig(**shapes, embedding_multiplier=12.0, attention_multiplier=0.1, residual_multiplier=0.22,
                             logits_scaling=8.0)
        )  # fmt: skip
    elif family == "olmo2":  # post-norms, whole-projection q/k norms
        model = tf.Olmo2ForCausalLM(tf.Olmo2Config(**shapes, pad_token_id=0))
    elif family == "olmo3":  # OLMo 2's layers, three local in four
        model = tf.Olmo3ForCausalLM(tf.Olmo3Config(**shapes, sliding_window=16, pad_token_id=0))
    elif family == "smollm3":  # NoPE every second layer
        model = tf.SmolLM3ForCausalLM(tf.SmolLM3Config(**shapes, no_rope_layer_interval=2, pad_token_id=0))
    elif family == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**shapes))
    elif family == "gemma2":
        model = tf.Gemma2ForCausalLM(
            tf.Gemma2Config(**shapes, sliding_window=16, query_pre_attn_scalar=32, attn_logit_softcapping=20.0,
                            final_logit_softcapping=10.0)
        )  # fmt: skip
    elif family == "gemma3":
        model = tf.Gemma3ForCausalLM(
            tf.Gemma3TextConfig(**shapes, sliding_window=16, query_pre_attn_scalar=32)
        )
    elif family == "mistral3-mm":
        vision = tf.PixtralVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
            image_size=28, patch_size=14,
        )  # fmt: skip
        model = tf.Mistral3ForConditionalGeneration(
            tf.Mistral3Config(text_config=tf.MistralConfig(**shapes, sliding_window=16).to_dict(),
                              vision_config=vision.to_dict(), tie_word_embeddings=shapes["tie_word_embeddings"])
        )  # fmt: skip
    else:
        text = tf.Gemma3TextConfig(**shapes, sliding_window=16, query_pre_attn_scalar=32)
        vision = tf.SiglipVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
            patch_size=14,
        )  # fmt: skip
        model = tf.Gemma3ForConditionalGeneration(
            tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                            tie_word_embeddings=shapes["tie_word_embeddings"])
        )  # fmt: skip
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(1.0 if "gemma" not in family else 0.0, 0.3)
    return model.eval()


def _fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x rounded through float8_e4m3fn with one scale per token (max |x| / 448)."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return (x / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale


def _int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 with one scale per token, as compressed-tensors does (max |x| / 127.5)."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.5
    return torch.clamp(torch.round(x / scale), -128, 127) * scale


def _dequantized(name: str) -> dict[str, torch.Tensor]:
    """``{checkpoint module: W [out, in]}`` as lorastar's Llama computes each quantized linear."""
    llama, _ = _load(name)
    mapping = type(llama).packed_modules_mapping
    out = {}
    with torch.inference_mode():
        for prefix, layer in llama.linears().items():
            if name == "w8a8":  # its input quantization would round the identity's ones: as held
                w = layer.quant_method.dequantized_weight(layer)
            else:
                w = layer.quant_method.apply(layer, torch.eye(layer.input_size), None).T  # [out, in]
            block, _, fused = prefix.rpartition(".")
            parts = mapping.get(fused, [fused])
            for part, piece in zip(parts, w.split(layer.output_sizes, dim=0)):
                out[f"{block}.{part}"] = piece.float().clone()
    return out


_NAMES = ("awq_g32", "gptq_act", "fp8_channel", "w4a16_g32", "w4a16_asym", "w8a16", "w8a8")
CASES = [(f, n) for f in FAMILIES for n in present(_NAMES) if f != "phi3" or n != "gptq_act"]
CASES += [("phi3", n) for n in present(("gptq_sym",))]


@pytest.mark.parametrize(("family", "name"), CASES, ids=[f"{f}-{n}" for f, n in CASES])
def test_quantized_checkpoint_of_each_family(tmp_path: Path, family: str, name: str) -> None:
    fx = read_config(name)
    hf = _hf_family(family, fx)
    quantized = {k: v for k, v in checkpoint(name).items() if "_proj." in k}
    if family == "phi3":
        quantized = _fuse(quantized, int4=not name.startswith("fp8") and name != "w8a8")
    mm = family.endswith("-mm")
    if mm:  # the language model's linears under its prefix; the vision tower's stay plain
        quantized = {k.replace("model.", _MM_PREFIX, 1): v for k, v in quantized.items()}
    plain = {
        k: v.contiguous()
        for k, v in hf.state_dict().items()
        if "_proj." not in k or (mm and not k.startswith(_MM_PREFIX))
    }
    if hf.config.tie_word_embeddings:
        plain.pop("lm_head.weight", None)
    save_file({**quantized, **plain}, str(tmp_path / "model.safetensors"))
    cfg = hf.config.to_dict()
    cfg["quantization_config"] = fx["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    from lorastar.models.loader import load_model, read_hf_config
    from lorastar.quant import get_quant_config

    cfg = read_hf_config(tmp_path)  # as the engine reads it (a multimodal config's text part)
    model, _ = load_model(
        tmp_path, cfg, dtype=torch.float32, device=torch.device("cpu"),
        quant=get_quant_config(cfg, None, torch.float32), max_positions=256,
    )  # fmt: skip
    kind = {
        "gemma3-mm": "Gemma3ForConditionalGeneration",
        "mistral3-mm": "Mistral3ForConditionalGeneration",
        "smollm3": "SmolLM3ForCausalLM",
        "granite": "GraniteForCausalLM",
        "olmo2": "Olmo2ForCausalLM",
        "olmo3": "Olmo3ForCausalLM",
    }.get(family, "GemmaForCausalLM" if "gemma" in family else "LlamaForCausalLM")
    assert type(model).__name__ == kind
    if family == "phi3":  # the fused tensors filled every shard
        assert any(".qkv_proj." in k for k in quantized) and not any(".q_proj." in k for k in quantized)
    deq = _dequantized(name)
    if family == "phi3":
        deq = _fuse(deq, int4=False)  # [out, in] weights: fused along dim 0
    with torch.no_grad():
        for module, w in deq.items():
            hf.get_submodule(module.replace("model.", _MM_PREFIX, 1) if mm else module).weight.copy_(w)
    if name.startswith("fp8") or name == "w8a8":
        # W8A8: each linear's input is quantized per token (dynamic), as llm-compressor's FP8_DYNAMIC
        # and W8A8 schemes run it: emulate that in the reference.
        per_token = _fp8_per_token if name.startswith("fp8") else _int8_per_token
        for module in deq:
            hf.get_submodule(
                module.replace("model.", _MM_PREFIX, 1) if mm else module
            ).register_forward_pre_hook(lambda _m, args, q=per_token: (q(args[0]),))
    gen = torch.Generator().manual_seed(3)
    for length in (5, 48):  # shorter and three times longer than the sliding window
        ids = torch.randint(0, fx["vocab_size"], (length,), generator=gen).tolist()
        with torch.no_grad():
            want = hf(input_ids=torch.tensor([ids])).logits[0].float()  # [T, vocab]
        got = _forward_logits(model, ids)
        err = ((got - want).abs().max() / want.abs().max()).item()
        print(f"{family}/{name} ({length} tokens): max logit error {err:.2e}")
        tol = FP8_TOL if name.startswith("fp8") or name == "w8a8" else INT4_TOL
        assert err < tol, f"{family}/{name}, {length} tokens: logits differ by {err:.2e} relative"


def test_one_scale_for_a_fused_tensor_fills_every_shard() -> None:
    """A fused checkpoint's per-tensor scale (one value for all of qkv_proj) goes to each shard's entry."""
    from lorastar.layers.linear import load_shard, set_param_meta

    p = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    set_param_meta(p, output_dim=None)
    load_shard(p, [4, 2, 2], torch.tensor([0.5]), None, "qkv_proj.weight_scale")
    assert p.tolist() == [0.5, 0.5, 0.5] and p.loaded_shards == {None}
    with pytest.raises(ValueError, match="does not match"):
        load_shard(p, [4, 2, 2], torch.ones(2), None, "qkv_proj.weight_scale")
