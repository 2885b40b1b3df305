"""The periodic stats line of a serving process, as vLLM's ``LoggingStatLogger`` writes it.

``lorastar serve`` logs one every ``LoraStarConfig.log_stats_interval`` seconds (10, as vLLM;
``--disable-log-stats``: none), ``lorastar engine`` one of its core's stats (``start_stats_thread``)::

    Avg prompt throughput: 512.0 tokens/s, Avg generation throughput: 96.3 tokens/s,
    Running: 16 reqs, Waiting: 2 reqs, KV cache usage: 41.2%, Prefix cache hit rate: 37.5%,
    Adapters: 3 running / 12 loaded

Throughputs and the hit rate are over the interval (counter deltas); the rest is as of now. As in
vLLM, a line is INFO while tokens flow and for the first idle interval after, DEBUG while idle (an
idle server does not fill its log). The adapters part appears once any adapter is loaded.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("lorastar")


class StatsLine:
    """Turns successive ``EngineStats`` snapshots into the log line (torch-free, clock passed in)."""

    def __init__(self) -> None:
        self._last: tuple[float, Any] | None = None  # (time, stats) of the previous snapshot
        self._was_busy = False

    def update(self, stats: Any, now: float) -> tuple[int, str] | None:
        """``(level, message)`` for the interval that ends with ``stats``; ``None`` for the first
        snapshot (no interval yet) and after a restart (its counters start again)."""
        last, self._last = self._last, (now, stats)
        if last is None:
            return None
        then, old = last
        if stats.prompt_tokens_total < old.prompt_tokens_total:  # a rebuilt engine counts from 0
            return None
        dt = max(now - then, 1e-9)
        prompt = (stats.prompt_tokens_total - old.prompt_tokens_total) / dt
        generation = (stats.generation_tokens_total - old.generation_tokens_total) / dt
        queries = stats.prefix_cache_queries - old.prefix_cache_queries
        hits = stats.prefix_cache_hits - old.prefix_cache_hits
        hit_rate = 100.0 * hits / queries if queries > 0 else 0.0
        parts = [
            f"Avg prompt throughput: {prompt:.1f} tokens/s",
            f"Avg generation throughput: {generation:.1f} tokens/s",
            f"Running: {stats.num_running} reqs",
            f"Waiting: {stats.num_waiting} reqs",
            f"KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%",
            f"Prefix cache hit rate: {hit_rate:.1f}%",
        ]
        if loaded := len(getattr(stats, "adapter_tiers", None) or ()):
            running = sum(1 for c in stats.adapters.values() if c.get("running"))
            parts.append(f"Adapters: {running} running / {loaded} loaded")
        spec, was = getattr(stats, "spec_decode", None), getattr(old, "spec_decode", None)
        if spec is not None and was is not None and (drafts := spec.num_drafts - was.num_drafts) > 0:
            # vLLM's "SpecDecoding metrics" of the interval (it logs them on a line of their own)
            drafted = spec.num_draft_tokens - was.num_draft_tokens
            kept = spec.num_accepted_tokens - was.num_accepted_tokens
            per_pos = ", ".join(
                f"{(a - b) / drafts:.3f}" for a, b in zip(spec.accepted_per_pos, was.accepted_per_pos)
            )
            parts.append(
                f"SpecDecoding: Mean acceptance length: {1 + kept / drafts:.2f}, Accepted: {kept} tokens, "
                f"Drafted: {drafted} tokens, Per-position acceptance rate: {per_pos}, "
                f"Avg Draft acceptance rate: {100.0 * kept / max(drafted, 1):.1f}%"
            )
        busy = bool(prompt or generation)
        level = logging.INFO if busy or self._was_busy else logging.DEBUG
        self._was_busy = busy
        return level, ", ".join(parts)


async def log_stats_every(interval: float, engine: Any) -> None:
    """Log ``engine``'s stats line every ``interval`` seconds until cancelled. ``engine.stats()``
    runs in a worker thread: an in-process engine's waits for its lock, held through a step."""
    line = StatsLine()
    while True:
        try:
            stats = await asyncio.to_thread(engine.stats)
        except Exception:  # noqa: BLE001 - a stats failure must not end the logging (or the app)
            logger.debug("lorastar: stats for the log line failed", exc_info=True)
        else:
            if stats is None:  # the engine is being rebuilt: its counters start again
                line = StatsLine()
            elif (out := line.update(stats, time.monotonic())) is not None:
                logger.log(*out)
        await asyncio.sleep(interval)


def start_stats_thread(interval: float, stats: Callable[[], Any]) -> Callable[[], None]:
    """``log_stats_every`` on a daemon thread, of ``stats()`` (``None``: restarting), for a process
    whose main thread steps an engine core (``lorastar engine``); returns what stops and joins it."""
    stop = threading.Event()

    def run() -> None:
        line = StatsLine()
        while True:
            try:
                snapshot = stats()
            except Exception:  # noqa: BLE001 - a stats failure must not end the logging
                logger.debug("lorastar: stats for the log line failed", exc_info=True)
            else:
                if snapshot is None:
                    line = StatsLine()
                elif (out := line.update(snapshot, time.monotonic())) is not None:
                    logger.log(*out)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=run, name="lorastar-stats-log", daemon=True)
    thread.start()

    def close() -> None:
        stop.set()
        thread.join(timeout=5.0)  # (stats() waits for the engine lock, held through a step)

    return close
