"""A snapshot of engine counters for /metrics and logs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks referenced by live sequences (0..1)
    num_blocks: int
    num_used_blocks: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of those, served from the cache
    prompt_tokens_total: int
    generation_tokens_total: int
    max_loras: int
    # adapter name -> {"running": n, "waiting": m}
    adapters: dict[str, dict[str, int]] = field(default_factory=dict)
    # adapter name -> generated tokens so far
    adapter_generation_tokens: dict[str, int] = field(default_factory=dict)
