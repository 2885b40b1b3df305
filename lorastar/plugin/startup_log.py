"""Start-up summary lines like vLLM's: model, dtype, device, quantization, KV cache, concurrency,
CUDA graphs, adapters and the URL. Read from the running engine's attributes; nothing is computed
twice."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("lorastar")


def startup_lines(engine: Any, served_name: str, url: str | None = None) -> list[str]:
    """The summary of an ``AsyncLLM`` (or ``LLM``); engines without a core (test fakes) get less."""
    core = getattr(engine, "engine", None)
    lines: list[str] = []
    if core is None or not hasattr(core, "kv_spec"):
        lines.append(f"Serving model {served_name!r}")
    else:
        cfg = core.config
        quant = getattr(core.quant_config, "name", None) or "none"
        lines.append(
            f"Model {core.model_name!r} from {core.model_dir} (served as {served_name!r}): "
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
        lines.append(
            f"LoRA: max_loras={cfg.max_loras} on the device, max_cpu_loras={cfg.max_cpu_loras}, "
            f"max_lora_rank={cfg.max_lora_rank}"
        )
    adapters = list(engine.list_adapters()) if hasattr(engine, "list_adapters") else []
    if adapters:
        shown = ", ".join(
            f"{a.name} (rank {getattr(a, 'rank', '?')}, {getattr(a, 'tier', '?')})" for a in adapters
        )
        lines.append(f"Adapters ({len(adapters)}): {shown}")
    else:
        lines.append("Adapters: none loaded")
    if url is not None:
        lines.append(f"OpenAI API at {url} (model={served_name!r} or an adapter name)")
    return lines


def log_startup(engine: Any, served_name: str, url: str | None = None) -> None:
    try:
        lines = startup_lines(engine, served_name, url)
    except Exception:  # a summary must never stop the server from starting
        logger.warning("lorastar: could not summarize the engine", exc_info=True)
        return
    for line in lines:
        logger.info(line)
