"""Start-up summary lines like vLLM's: model, dtype, device, quantization, KV cache, concurrency,
CUDA graphs, adapters and the URL. Read from the running engine's attributes; nothing is computed
twice."""

from __future__ import annotations

import logging
from typing import Any

from lorastar.engine.summary import engine_summary

logger = logging.getLogger("lorastar")


def startup_lines(engine: Any, served_name: str, url: str | None = None) -> list[str]:
    """The summary of an ``AsyncLLM`` (or ``LLM``); engines without a core (test fakes) get less."""
    core = getattr(engine, "engine", None)
    lines = [f"Serving model {served_name!r}"]
    if core is not None and hasattr(core, "kv_spec"):
        lines += engine_summary(core)
    else:  # a client of an engine core process: the core's lines (test fakes have none)
        lines += getattr(engine, "summary", [])
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
