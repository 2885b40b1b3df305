"""The engine's start-up summary lines (vLLM-like): model, dtype, device, quantization, KV cache,
concurrency, CUDA graphs, CPU threads and OpenMP wait, LoRA limits. Read from a built ``LLMEngine``; nothing is computed twice."""

from __future__ import annotations

import os
from typing import Any

from lorastar.engine.generation_config import defaults_source


def engine_info(core: Any) -> dict[str, Any]:
    """The facts the operator page's header shows, for an ``LLMEngine`` (a core process sends them
    to its clients in ``Ready.info``)."""
    return {
        "dtype": str(core.dtype).removeprefix("torch."),
        "device": str(core.device),
        "max_model_len": core.max_model_len,
        "block_size": core.kv_spec.block_size,
    }


def engine_summary(core: Any) -> list[str]:
    """The lines for an ``LLMEngine`` (the plugin logs them; a core process sends them to its clients)."""
    lines: list[str] = []
    cfg = core.config
    quant = getattr(core.quant_config, "name", None) or "none"
    lines.append(
        f"Model {core.model_name!r} from {core.model_dir}: "
        f"dtype={str(core.dtype).removeprefix('torch.')}, device={core.device}, quantization={quant}, "
        f"kv_cache_dtype={cfg.kv_cache_dtype}, max_model_len={core.max_model_len}"
    )
    spec = core.kv_spec
    tokens = spec.num_blocks * spec.block_size
    gib = spec.num_blocks * spec.bytes_per_block / 2**30
    lines.append(
        f"KV cache: {spec.num_blocks} blocks of {spec.block_size} tokens = {tokens} tokens ({gib:.2f} GiB)"
    )
    lines.append(
        f"Maximum concurrency for {core.max_model_len} tokens per request: "
        f"{tokens / core.max_model_len:.2f}x (max_num_seqs={cfg.max_num_seqs})"
    )
    graphs = getattr(getattr(core, "runner", None), "graphs", None)
    if graphs is not None:
        lines.append(f"CUDA graphs: decode batches up to {min(cfg.max_num_seqs, 256)} captured")
    else:
        why = "enforce_eager" if cfg.enforce_eager else f"not on {core.device.type}"
        lines.append(f"CUDA graphs: off ({why})")
    if core.device.type == "cpu":  # what CPU speed hangs on (layers/cpu_gemm.py, lorastar/__main__.py)
        import torch

        spin = os.environ.get("GOMP_SPINCOUNT")
        wait = (
            f"GOMP_SPINCOUNT={spin}"
            if spin
            else f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"
        )
        lines.append(
            f"CPU: {torch.get_num_threads()} threads, GEMM {core.cpu_gemm}, kernels {core.cpu_kernels}, "
            f"OpenMP wait {wait}"
        )
    lines.append(
        f"LoRA: max_loras={cfg.max_loras} on the device, max_cpu_loras={cfg.max_cpu_loras}, "
        f"max_lora_rank={cfg.max_lora_rank}"
    )
    if (spec := getattr(core, "speculative", None)) is not None:
        lines.append(
            f"Speculative decoding: {spec.method}, up to {spec.num_speculative_tokens} drafted tokens per step "
            f"(n-grams of {spec.prompt_lookup_min}-{spec.prompt_lookup_max} tokens); async scheduling off"
        )
    if defaults := getattr(core, "default_sampling", None):  # vLLM warns of these too
        shown = ", ".join(f"{k}={v}" for k, v in defaults.items())
        source = defaults_source(cfg.generation_config, cfg.override_generation_config)
        lines.append(
            f"Sampling defaults from {source}: {shown} (--generation-config vllm: none from the model)"
        )
    return lines
