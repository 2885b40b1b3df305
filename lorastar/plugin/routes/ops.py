"""The live operator page (``GET /lorastar/``: static HTML + JS, no build step) and the small JSON
stats route it polls (``GET /lorastar/stats``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from litestar import get
from litestar.datastructures import CacheControlHeader
from litestar.static_files import create_static_files_router

from lorastar.plugin.service import LoraStarService

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"


def _counter_by_adapter(counter: Any) -> dict[str, float]:
    """``{adapter: value}`` of a labelled prometheus Counter (its ``_total`` samples)."""
    out: dict[str, float] = {}
    if counter is None:
        return out
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                name = sample.labels.get("adapter", "")
                out[name] = out.get(name, 0.0) + sample.value
    return out


def stats_snapshot(service: LoraStarService) -> dict[str, Any]:
    """Everything the page shows, in one JSON object (engine counters + per-adapter traffic)."""
    engine = service.engine if service.started else None
    snap: dict[str, Any] = {
        "time": time.time(),
        "model": service.served_model_name,
        "healthy": service.healthy(),
    }
    # dtype, device, max_model_len, block_size (summary.engine_info): AsyncLLM computes them from its
    # engine, a core process's client has them from the core (test fakes: none)
    snap.update(getattr(engine, "info", None) or {})
    stats = service._stats()  # None until started (or while stopping)
    if stats is not None:
        snap.update(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_cache_usage=stats.kv_cache_usage,
            num_blocks=stats.num_blocks,
            num_used_blocks=stats.num_used_blocks,
            num_preemptions=stats.num_preemptions,
            prompt_tokens_total=stats.prompt_tokens_total,
            generation_tokens_total=stats.generation_tokens_total,
            max_loras=stats.max_loras,
        )
        spec = getattr(stats, "spec_decode", None)
        if spec is not None:  # speculative decoding's counters (vLLM's spec_decode_*)
            snap["spec_decode"] = dict(
                num_drafts=spec.num_drafts, num_draft_tokens=spec.num_draft_tokens,
                num_accepted_tokens=spec.num_accepted_tokens, accepted_per_pos=list(spec.accepted_per_pos),
            )  # fmt: skip
    m = service.metrics
    requests = _counter_by_adapter(getattr(m, "adapter_requests", None))
    prompt = _counter_by_adapter(getattr(m, "adapter_prompt_tokens", None))
    generated = _counter_by_adapter(getattr(m, "adapter_generation_tokens", None))
    live = stats.adapters if stats is not None else {}
    rows: list[dict[str, Any]] = []
    base = service.served_model_name
    rows.append(
        dict(name=base, base=True, rank=None, tier="base", slot=None, running=None, waiting=None,
             requests=int(requests.get(base, 0)), prompt_tokens=int(prompt.get(base, 0)),
             generation_tokens=int(generated.get(base, 0)))
    )  # fmt: skip
    for a in engine.list_adapters() if engine is not None else []:
        counts = live.get(a.name, {})
        rows.append(
            dict(name=a.name, base=False, rank=getattr(a, "rank", None), tier=getattr(a, "tier", "?"),
                 slot=getattr(a, "slot", None),
                 running=counts.get("running", 0), waiting=counts.get("waiting", 0),
                 requests=int(requests.get(a.name, 0)), prompt_tokens=int(prompt.get(a.name, 0)),
                 generation_tokens=int(generated.get(a.name, 0)))
        )  # fmt: skip
    snap["adapters"] = rows
    return snap


def build_ops_handlers(service: LoraStarService, *, guards: list[Any] | None = None) -> list[Any]:
    # In a worker thread: an in-process engine's stats() waits for its lock, held through a step
    @get("/lorastar/stats", sync_to_thread=True, guards=guards or [], summary="Operator page stats")
    def stats() -> dict[str, Any]:
        return stats_snapshot(service)

    page = create_static_files_router(
        path="/lorastar",
        directories=[STATIC_DIR],
        html_mode=True,
        include_in_schema=False,
        # no guards: a browser cannot send the API key on navigation; the page holds no data and
        # asks for the key when stats answers 401. no-cache: revalidate (ETag) after an upgrade
        cache_control=CacheControlHeader(no_cache=True),
    )
    return [stats, page]
