"""Shared test setup. Triton runs in its interpreter when no GPU is present."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp: see lorastar/__init__.py

import pytest  # noqa: E402

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch always present in the venv
    _HAS_CUDA = False

# Must be set before any @triton.jit function is first launched.
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs two workers), each worker's torch takes its share of the
# cores: two workers with two threads each on CI's 2 cores would oversubscribe them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# ---- tiny real checkpoints (random weights, SmolLM2's tokenizer) ------------------------------
TINY_CONFIGS: dict[str, dict] = {
    # GQA, untied embeddings
    "llama-gqa": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    # MHA, tied embeddings, llama3 rope scaling
    "llama-mha-llama3": dict(
        arch="llama",
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # Qwen2: q/k/v bias, GQA, tied
    "qwen2": dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # Qwen3: per-head q/k RMSNorm, head_dim wider than hidden / heads, untied and tied
    "qwen3": dict(
        arch="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False
    ),
    "qwen3-tied": dict(
        arch="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True
    ),
    # The plugin tests' model: tied, weights std 0.08 (sharper logits: greedy is no near-tie lottery)
    "llama-plugin": dict(
        arch="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, init_std=0.08
    ),
    # Long context, one layer: 4k-token prompts (prompt logprobs' memory bound)
    "llama-long": dict(
        arch="llama",
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        max_position_embeddings=4608,
        tie_word_embeddings=True,
    ),  # fmt: skip
    # Sliding windows several times shorter than the test sequences: every layer (Mistral: blocks
    # outside the window are freed), and only layers >= max_window_layers (Qwen2: all blocks kept)
    "mistral-window": dict(
        arch="mistral",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        sliding_window=24,
    ),
    "qwen2-window": dict(
        arch="qwen2",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=20,
        max_window_layers=1,
    ),
    # Gemma 2: alternating local/global layers, both soft-caps, query_pre_attn_scalar != head_dim
    "gemma2": dict(
        arch="gemma2",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=24,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=8.0,
        final_logit_softcapping=0.5,
    ),
    # Gemma 3: q/k norms, two RoPE bases (global one linearly scaled), local-global-local layers
    "gemma3": dict(
        arch="gemma3",
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=20,
        query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
    ),
    # Phi-3: fused qkv_proj / gate_up_proj in the checkpoint, untied, GQA
    "phi3": dict(arch="phi3", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    # Phi-4-mini: partial rotary (3/4 of each head), longrope (short / long factors, attention factor)
    "phi4-mini": dict(
        arch="phi3",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        original_max_position_embeddings=64,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.1 * i for i in range(6)],  # rotary dims / 2 = 16 * 0.75 / 2
            "long_factor": [1.0 + 0.9 * i for i in range(6)],
            "original_max_position_embeddings": 64,
        },
    ),
    # Mistral: GQA, untied, sliding window wider than any test sequence
    "mistral": dict(
        arch="mistral",
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        sliding_window=4096,
    ),
    # SmolLM3: Llama with NoPE layers (no rotary at all), here every second one; tied, GQA
    "smollm3": dict(
        arch="smollm3",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        no_rope_layer_interval=2,
    ),
    # Granite 3.x: Llama with four multipliers (embeddings, attention scale, residual, logits); GQA, tied
    "granite": dict(
        arch="granite",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        embedding_multiplier=12.0,
        attention_multiplier=0.1,
        residual_multiplier=0.22,
        logits_scaling=8.0,
    ),
    # OLMo 2: norms after each block, q/k normalized over the whole projection; GQA, untied
    "olmo2": dict(arch="olmo2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    # OLMo 3: OLMo 2's layers, local-global, a RoPE per layer type (YaRN on the global one)
    "olmo3": dict(
        arch="olmo3",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        sliding_window=20,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {
                "rope_type": "yarn",
                "rope_theta": 500000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),  # fmt: skip
    # SmolLM3 with use_sliding_window: only the NoPE layers slide (transformers' layer_types)
    "smollm3-window": dict(
        arch="smollm3",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        no_rope_layer_interval=2,
        use_sliding_window=True,
        sliding_window=20,
    ),
}
# Gemma 3 4B-27B's shape: the same decoder inside Gemma3ForConditionalGeneration, beside a (tiny)
# SigLIP vision tower and projector that a text server skips
TINY_CONFIGS["gemma3-mm"] = {**TINY_CONFIGS["gemma3"], "arch": "gemma3-mm"}
# Mistral Small 3.1/3.2's shape: a Mistral decoder (no sliding window, untied) inside
# Mistral3ForConditionalGeneration, beside a (tiny) Pixtral vision tower and projector
TINY_CONFIGS["mistral3-mm"] = {**TINY_CONFIGS["mistral"], "arch": "mistral3-mm", "sliding_window": None}
# Ministral 3's shape: its decoder (YaRN, Llama 4's query scaling) in Mistral3ForConditionalGeneration;
# an original context of 16 (16k released) so that both act within the tests' sequences
TINY_CONFIGS["ministral3-mm"] = {
    **TINY_CONFIGS["mistral3-mm"],
    "text_arch": "ministral3",
    "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 16,
        "max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1,
    },
}  # fmt: skip
# Qwen3 with YaRN (its long-context setting), here past an original context of 64
TINY_CONFIGS["qwen3-yarn"] = {
    **TINY_CONFIGS["qwen3"],
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                        "original_max_position_embeddings": 64},
}  # fmt: skip


def hf_model(path, dtype=None):  # noqa: ANN001, ANN201
    """transformers' model of a test checkpoint: ``AutoModelForCausalLM``'s, or for Mistral 3 (which
    that auto class does not map) ``Mistral3ForConditionalGeneration``."""
    import json
    from pathlib import Path

    import torch
    import transformers

    archs = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
    cls = (
        transformers.Mistral3ForConditionalGeneration
        if "Mistral3ForConditionalGeneration" in archs
        else transformers.AutoModelForCausalLM
    )
    return cls.from_pretrained(str(path), dtype=dtype or torch.float32)


def make_tiny_model(path, name: str, seed: int = 0):  # noqa: ANN201
    """Write a tiny random Llama/Mistral/Qwen2/Qwen3/Gemma/Phi-3/SmolLM3/Granite/OLMo checkpoint (Gemma 3 also as
    ``Gemma3ForConditionalGeneration``, Mistral as ``Mistral3ForConditionalGeneration``) + SmolLM2's
    tokenizer into ``path``."""
    import shutil
    from pathlib import Path

    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    from lorastar.models.default import default_model_dir

    spec = dict(TINY_CONFIGS[name])
    arch = spec.pop("arch")
    text_arch = spec.pop("text_arch", "mistral")
    init_std = spec.pop("init_std", None)
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        vocab_size=49152,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    kw = {**common, **spec}
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    elif arch == "phi3":
        from transformers import Phi3Config, Phi3ForCausalLM

        model = Phi3ForCausalLM(Phi3Config(**kw, pad_token_id=0))
    elif arch in ("gemma2", "gemma3", "gemma3-mm"):
        from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

        kw.pop("rms_norm_eps")
        if arch == "gemma2":
            model = Gemma2ForCausalLM(Gemma2Config(**kw, rms_norm_eps=1e-6))
        elif arch == "gemma3":
            model = Gemma3ForCausalLM(Gemma3TextConfig(**kw, rms_norm_eps=1e-6))
        else:
            from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

            text = Gemma3TextConfig(**kw, rms_norm_eps=1e-6)
            vision = SiglipVisionConfig(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                image_size=28, patch_size=14,
            )  # fmt: skip
            cfg = Gemma3Config(
                text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4
            )
            model = Gemma3ForConditionalGeneration(cfg)
        with torch.no_grad():  # Gemma norms start at zero (weight 1 + 0): make them matter
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.normal_(0.0, 0.3)
                elif "q_proj" in n or "k_proj" in n:  # attention logits big enough for the cap to bend
                    p.normal_(0.0, 0.5)
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**kw))
    elif arch == "granite":
        from transformers import GraniteConfig, GraniteForCausalLM

        model = GraniteForCausalLM(GraniteConfig(**kw))
        with torch.no_grad():  # attention logits large enough for attention_multiplier to matter
            for n, p in model.named_parameters():
                if "q_proj" in n or "k_proj" in n:
                    p.normal_(0.0, 0.5)
    elif arch in ("olmo2", "olmo3"):
        import transformers

        name_ = "Olmo2" if arch == "olmo2" else "Olmo3"
        model_cls, cfg_cls = (
            getattr(transformers, f"{name_}ForCausalLM"),
            getattr(transformers, f"{name_}Config"),
        )
        model = model_cls(cfg_cls(**kw, pad_token_id=0))
        with torch.no_grad():  # random init leaves the norms at one: make them matter
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.normal_(1.0, 0.3)
    elif arch == "smollm3":
        from transformers import SmolLM3Config, SmolLM3ForCausalLM

        model = SmolLM3ForCausalLM(SmolLM3Config(**kw, pad_token_id=0))
    elif arch == "mistral3-mm":
        from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralVisionConfig

        if text_arch == "ministral3":
            from transformers import Ministral3Config

            text = Ministral3Config(**kw)
        else:
            text = MistralConfig(**kw)
        vision = PixtralVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
            image_size=28, patch_size=14,
        )  # fmt: skip
        model = Mistral3ForConditionalGeneration(
            Mistral3Config(
                text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=False
            )
        )
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**kw))
        with torch.no_grad():  # random init leaves the q/k norms at one: make them matter
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
        with torch.no_grad():  # random init leaves biases at zero: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if init_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, init_std)
    model.save_pretrained(path)
    # LORASTAR_TEST_TOKENIZER: a folder with SmolLM2's tokenizer files, for machines (the GPU box)
    # where the embedded model can't be converted.
    src = Path(os.environ.get("LORASTAR_TEST_TOKENIZER") or default_model_dir())
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / f).is_file():
            shutil.copy(src / f, Path(path) / f)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):  # noqa: ANN001, ANN201
    """Factory: ``tiny_model_dir("llama-gqa")`` -> folder (made once per session)."""
    made: dict[str, str] = {}

    def get(name: str = "llama-gqa") -> str:
        if name not in made:
            made[name] = str(make_tiny_model(tmp_path_factory.mktemp(name), name))
        return made[name]

    return get


ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(
    base_dir,  # noqa: ANN001 - str or Path
    out,  # noqa: ANN001
    seed: int,
    *,
    r: int = 8,
    alpha: int | None = None,
    targets: tuple[str, ...] | list[str] = ("q_proj", "v_proj", "down_proj"),
    scale: float = 0.3,
    map_targets=None,  # noqa: ANN001 - (base model, targets) -> the module names PEFT should wrap
    **config,  # noqa: ANN003 - more LoraConfig fields (use_rslora, ...)
) -> str:
    """A real PEFT LoRA folder for ``base_dir`` with random non-zero A and B (a visible delta): the
    one adapter builder of the test suite (``make_peft_adapters`` builds several)."""
    import torch
    from peft import LoraConfig, get_peft_model

    base = hf_model(base_dir, torch.float32)
    names = list(targets) if map_targets is None else map_targets(base, list(targets))
    model = get_peft_model(
        base, LoraConfig(r=r, lora_alpha=alpha or 2 * r, target_modules=names, lora_dropout=0.0, **config)
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


def make_peft_adapters(
    base_dir,  # noqa: ANN001
    out,  # noqa: ANN001
    specs: dict[str, dict],
    *,
    seed: int,
    scale: float = 0.3,
    map_targets=None,  # noqa: ANN001
) -> dict[str, str]:
    """``{name: folder}`` for ``specs`` (``{name: LoraConfig kwargs}``), adapter ``i`` seeded ``seed + i``."""
    from pathlib import Path

    paths = {}
    for i, (name, kw) in enumerate(specs.items()):
        kw = dict(kw)
        r, alpha, targets = kw.pop("r"), kw.pop("lora_alpha", None), kw.pop("target_modules")
        paths[name] = make_peft_adapter(
            base_dir, Path(out) / name, seed + i, r=r, alpha=alpha, targets=targets, scale=scale,
            map_targets=map_targets, **kw,
        )  # fmt: skip
    return paths


def prefill_logits(model, ids: list[int], *, dtype=None):  # noqa: ANN001, ANN201
    """Teacher-forced logits ``[T, vocab]`` of every position of ``ids``: one prefill through the
    engine's own runner and input preparation (a fresh cache of the model's dtype, or ``dtype``)."""
    import torch

    from lorastar.engine.request import Request
    from lorastar.engine.runner import KVCacheSpec, ModelRunner
    from lorastar.engine.sampling import SamplingParams
    from lorastar.engine.scheduler import ScheduledSeq, SchedulerOutput

    bs = 16
    nb = -(-len(ids) // bs)
    norm = model.norm.weight  # a float parameter that every model keeps: its device and dtype
    spec = KVCacheSpec(nb, bs, model.num_layers, model.num_kv_heads, model.head_dim, dtype or norm.dtype)
    runner = ModelRunner(model, spec, norm.device)
    seq = Request("prefill", None, list(ids), SamplingParams(max_tokens=1)).sequences[0]
    seq.block_table = list(range(nb))
    input_ids, positions, ctx, _ = runner.prepare(SchedulerOutput([ScheduledSeq(seq, 0, len(ids))]))
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, positions, ctx))
