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
    # adapter name -> "device" (holds a slot) | "cpu" (weights in host memory) | "disk"
    adapter_tiers: dict[str, str] = field(default_factory=dict)
    block_size: int = 0
    cache_dtype: str = "auto"
    enable_prefix_caching: bool = False
    # Tokens per engine step (vLLM's iteration_tokens_total): cumulative bucket counts and sum.
    iteration_tokens: TokenHistogram | None = None
    # Speculative decoding's counters; None: off.
    spec_decode: SpecDecodeStats | None = None


# vLLM's buckets for tokens per step.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class TokenHistogram:
    """A Prometheus-style histogram kept by the engine (torch-free; one ``observe`` per step)."""

    buckets: tuple[int, ...] = ITERATION_TOKEN_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))  # last: +Inf
    total: float = 0.0

    def observe(self, value: int) -> None:
        i = next((j for j, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += 1
        self.total += value

    def snapshot(self) -> TokenHistogram:
        return TokenHistogram(self.buckets, list(self.counts), self.total)


@dataclass
class SpecDecodeStats:
    """Speculative decoding's cumulative counters (vLLM's ``spec_decode_*`` metrics)."""

    num_speculative_tokens: int
    num_drafts: int = 0  # sequence-steps that ran drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [num_speculative_tokens]

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_speculative_tokens, self.num_drafts, self.num_draft_tokens,
            self.num_accepted_tokens, list(self.accepted_per_pos),
        )  # fmt: skip
