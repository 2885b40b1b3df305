"""Prometheus metrics with vLLM's names (so existing vLLM dashboards and gateways work).

Each plugin instance owns a ``CollectorRegistry``: tests and apps may build many plugins in one
process, and the global registry would reject the second set of names. This is also why the route
does not reuse ``litestar.plugins.prometheus.PrometheusController``: it always reads the global
``REGISTRY``. We reuse ``prometheus_client`` for everything else.

Gauges and engine-wide counters are read from ``AsyncLLM.stats()`` at scrape time (a custom
collector); latencies and per-adapter counters are observed by the routes as outputs stream by.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4"  # Litestar appends the charset

# vLLM's buckets.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

# vLLM's 1-2-5 buckets for token counts (up to a 128k context).
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5) if m * 10**e <= 131072)


def _get(obj: Any, name: str, default: Any = 0) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


class _EngineCollector:
    """Reads the engine's live numbers at scrape time."""

    def __init__(
        self,
        stats: Callable[[], Any],
        model_name: Callable[[], str],
        max_loras: Callable[[], int],
        on_collect: Callable[[str], None] | None = None,
    ) -> None:
        self._stats = stats
        self._model_name = model_name
        self._max_loras = max_loras
        self._on_collect = on_collect  # called with the served name while the engine runs

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return
        name = self._model_name()
        if self._on_collect is not None:
            self._on_collect(name)
        labels = ["model_name"]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=labels)
            g.add_metric([name], float(value))
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(metric, doc, labels=labels)
            c.add_metric([name], float(value))
            return c

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            _get(stats, "num_running"),
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            _get(stats, "num_waiting"),
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            _get(stats, "kv_cache_usage", 0.0),
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemptions from the engine.",
            _get(stats, "num_preemptions"),
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            _get(stats, "prefix_cache_queries"),
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            _get(stats, "prefix_cache_hits"),
        )
        # The names vLLM's production-stack router (and older dashboards) still read.
        yield gauge(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage (older name of vllm:kv_cache_usage_perc).",
            _get(stats, "kv_cache_usage", 0.0),
        )
        yield counter(
            "vllm:gpu_prefix_cache_queries",
            "Prefix cache queries, in tokens (older name of vllm:prefix_cache_queries).",
            _get(stats, "prefix_cache_queries"),
        )
        yield counter(
            "vllm:gpu_prefix_cache_hits",
            "Prefix cache hits, in tokens (older name of vllm:prefix_cache_hits).",
            _get(stats, "prefix_cache_hits"),
        )
        queries = _get(stats, "prefix_cache_queries")
        yield gauge(
            "vllm:gpu_prefix_cache_hit_rate",
            "Prefix cache hit rate since start (hits / queried tokens).",
            _get(stats, "prefix_cache_hits") / queries if queries else 0.0,
        )
        info_labels = {
            "block_size": str(_get(stats, "block_size")),
            "cache_dtype": str(_get(stats, "cache_dtype", "auto")),
            "enable_prefix_caching": str(bool(_get(stats, "enable_prefix_caching", False))),
            "num_cpu_blocks": "0",
            "num_gpu_blocks": str(_get(stats, "num_blocks")),
        }
        cache_info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig.", labels=list(info_labels)
        )
        cache_info.add_metric(list(info_labels.values()), 1.0)
        yield cache_info
        hist = _get(stats, "iteration_tokens", None)
        if hist is not None:
            h = HistogramMetricFamily(
                "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", labels=labels
            )
            cumulative, running_count = [], 0
            for bound, n in zip([*map(str, hist.buckets), "+Inf"], hist.counts):
                running_count += n
                cumulative.append((bound, float(running_count)))
            h.add_metric([name], cumulative, float(hist.total))
            yield h
        spec = _get(stats, "spec_decode", None)
        if spec is not None:  # vLLM's speculative decoding counters
            yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts)
            yield counter(
                "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens
            )
            yield counter(
                "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens
            )
            per_pos = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                labels=[*labels, "position"],
            )
            for pos, n in enumerate(spec.accepted_per_pos):
                per_pos.add_metric([name, str(pos)], float(n))
            yield per_pos
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", _get(stats, "prompt_tokens_total")
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            _get(stats, "generation_tokens_total"),
        )

        # vLLM's info gauge: comma-joined adapter names in the labels, the scrape time as the value.
        running: list[str] = []
        waiting: list[str] = []
        adapters = _get(stats, "adapters", None) or {}
        items = (
            adapters.items() if isinstance(adapters, dict) else ((_get(a, "name", ""), a) for a in adapters)
        )
        tiers: dict[str, str] = _get(stats, "adapter_tiers", None) or {}
        # "running" lists the adapters resident in device slots (routers read it as "loaded in GPU
        # memory"; a warm adapter with no request in flight still routes best to this replica),
        # plus any with requests running; "waiting": adapters with queued requests, not resident.
        resident = {a for a, t in tiers.items() if t == "device"}
        for adapter, counts in items:
            if _get(counts, "running", _get(counts, "num_running", 0)):
                resident.add(str(adapter))
        running = sorted(resident)
        for adapter, counts in items:
            if _get(counts, "waiting", _get(counts, "num_waiting", 0)) and str(adapter) not in resident:
                waiting.append(str(adapter))
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        max_lora = _get(stats, "max_loras", None) or self._max_loras()
        info.add_metric([str(max_lora), ",".join(sorted(waiting)), ",".join(running)], time.time())
        yield info
        held = GaugeMetricFamily(
            "lorastar:lora_adapter_info",
            "1 for each adapter this server holds, by tier: device (a LoRA slot) or cpu (host memory).",
            labels=["model_name", "adapter", "tier"],
        )
        for adapter, tier in sorted(tiers.items()):
            if tier in ("device", "cpu"):
                held.add_metric([name, adapter, tier], 1.0)
        yield held


class PluginMetrics:
    """The plugin's metric set, on its own registry."""

    def __init__(
        self, stats: Callable[[], Any], model_name: Callable[[], str], max_loras: Callable[[], int]
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._model_name = model_name
        self._itl_child: tuple[str, Any] | None = None  # (served name, its ITL histogram)
        self._success_named: str | None = None  # the served name whose success series exist
        # Registered first: it creates the success series before the same scrape reads them.
        self.registry.register(
            _EngineCollector(stats, model_name, max_loras, self._create_success_series)  # type: ignore[arg-type]
        )
        r = self.registry
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds (from the request's submission to the "
            "engine to its first generated token, of any choice).",
            ["model_name"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds: one observation per generated token after "
            "its choice's first, the gap since the choice's previous token (a non-streamed request: "
            "the engine's first-to-last token time spread evenly over the longest choice's gaps).",
            ["model_name"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            ["model_name"],
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            ["model_name"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            ["model_name"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.phase = {
            phase: Histogram(
                f"vllm:request_{phase}_time_seconds",
                doc,
                ["model_name"],
                buckets=_E2E_BUCKETS,
                registry=r,
            )
            for phase, doc in (
                ("queue", "Histogram of time spent in WAITING phase for request."),
                ("prefill", "Histogram of time spent in PREFILL phase for request."),
                ("decode", "Histogram of time spent in DECODE phase for request."),
                ("inference", "Histogram of time spent in RUNNING phase for request."),
            )
        }
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.adapter_requests = Counter(
            "lorastar:adapter_requests",
            "Requests per adapter (the base's served name for the base model).",
            ["model_name", "adapter"],
            registry=r,
        )
        self.adapter_prompt_tokens = Counter(
            "lorastar:adapter_prompt_tokens",
            "Prompt tokens per adapter.",
            ["model_name", "adapter"],
            registry=r,
        )
        self.adapter_generation_tokens = Counter(
            "lorastar:adapter_generation_tokens",
            "Generated tokens per adapter.",
            ["model_name", "adapter"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _create_success_series(self, name: str) -> None:
        """vLLM's ``request_success_total`` has a series per finished_reason from the start, at 0:
        one that appeared at 1 would hide its first request from ``rate()`` and ``increase()``."""
        if name != self._success_named:
            for reason in ("stop", "length", "abort"):
                self.success.labels(name, reason)
            self._success_named = name

    def forget_adapter(self, adapter: str) -> None:
        """Drop an unloaded adapter's per-adapter series: one set per name ever served would grow
        without bound (vLLM keeps no series of an unloaded adapter; loaded again, they restart at 0)."""
        name = self._model_name()
        for counter in (self.adapter_requests, self.adapter_prompt_tokens, self.adapter_generation_tokens):
            try:
                counter.remove(name, adapter)
            except KeyError:  # none yet (never served)
                pass

    # --- observations (called by the routes) ---

    def request_started(self, adapter: str) -> None:
        self.adapter_requests.labels(self._model_name(), adapter).inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self._model_name()).observe(max(seconds, 0.0))

    def inter_token(self, gap: float, count: int = 1) -> None:
        """``count`` tokens, each ``gap`` seconds after its choice's previous token: ``count``
        observations of ``gap`` (1.4 us each: an 8k-token answer's take 11 ms, once). Called per
        stream frame: the labelled histogram is kept while the served name stays the same."""
        name = self._model_name()
        cached = self._itl_child
        if cached is None or cached[0] != name:
            cached = self._itl_child = (name, self.itl.labels(name))
        h = cached[1]
        for _ in range(count):
            h.observe(max(gap, 0.0))

    def request_finished(
        self,
        adapter: str,
        seconds: float,
        prompt_tokens: int,
        generation_tokens: int,
        reason: str,
        times: Any = None,
    ) -> None:
        """One finished request (all its choices): ``reason`` is its first choice's finish reason;
        ``times`` its ``RequestMetrics`` (engine timestamps) when the engine gave them."""
        name = self._model_name()
        self.e2e.labels(name).observe(max(seconds, 0.0))
        self.prompt_tokens.labels(name).observe(prompt_tokens)
        self.generation_tokens.labels(name).observe(generation_tokens)
        self.adapter_prompt_tokens.labels(name, adapter).inc(prompt_tokens)
        self.adapter_generation_tokens.labels(name, adapter).inc(generation_tokens)
        self.success.labels(name, reason or "unknown").inc()
        if times is None:
            return
        arrival, scheduled = times.arrival_time, times.first_scheduled_time
        first, last = times.first_token_time, times.last_token_time
        for phase, a, b in (("queue", arrival, scheduled), ("prefill", scheduled, first),
                            ("decode", first, last), ("inference", scheduled, last)):  # fmt: skip
            if a is not None and b is not None:
                self.phase[phase].labels(name).observe(max(b - a, 0.0))


class RequestTimer:
    """One request's token latencies, as vLLM defines them, from the outputs the service sees.

    TTFT: from ``t0`` (the service's ``time.monotonic()`` just before it submits the request) to
    the request's first generated token. A stream observes it when the first token reaches the
    service; a non-streamed request (FINAL_ONLY: the first output is the final one) reads the
    engine's ``first_token_time``. The engine's timestamps are ``time.monotonic()`` too, on this
    host (an engine core process included: CLOCK_MONOTONIC is system-wide), taken after ``t0``; one
    outside ``[t0, now]`` is from another clock (a remote or fake engine) and is not used.

    ITL: one observation per token after its choice's first, the gap since that choice's previous
    token (tokens of other choices do not count; a choice's first token is no gap). Tokens of one
    choice that arrive together are spread over the time since its previous token (its first:
    since the engine's ``first_token_time``). A non-streamed request only has the request's first
    and last token times: its choices step together, so each gap is (last - first) / (longest
    choice's tokens - 1), observed once per token after each choice's first (count and sum right
    for one choice; an approximation when choices differ in pace). Without engine timestamps a
    non-streamed request observes no ITL (the gaps are unknown).
    """

    def __init__(self, metrics: PluginMetrics, t0: float, *, delta: bool, final_only: bool) -> None:
        self.metrics = metrics
        self.t0 = t0
        self.delta = delta  # outputs hold only new tokens (else every output holds all so far)
        self.final_only = final_only
        self.seen_first = False
        self.choices: dict[int, tuple[int, float]] = {}  # index -> (tokens so far, last one's time)

    def _engine_time(self, value: float | None, now: float) -> float | None:
        return value if value is not None and self.t0 <= value <= now else None

    def observe(self, out: Any, now: float) -> int:
        """Account output ``out`` (seen at ``now``); the tokens generated so far, all choices."""
        times = out.metrics
        first = self._engine_time(times.first_token_time if times is not None else None, now)
        if self.final_only:
            if out.finished:
                self._final(out, now, first, times)
            return sum(len(o.token_ids) for o in out.outputs)
        for o in out.outputs:
            have, last = self.choices.get(o.index, (0, None))
            new = len(o.token_ids) if self.delta else len(o.token_ids) - have
            if new <= 0:
                continue
            if not self.seen_first:
                self.seen_first = True
                self.metrics.first_token(now - self.t0)
            if last is None:  # the choice's first token; any others came with it
                if new > 1:
                    since = first if first is not None else now
                    self.metrics.inter_token((now - since) / (new - 1), new - 1)
            else:
                self.metrics.inter_token((now - last) / new, new)
            self.choices[o.index] = (have + new, now)
        if self.delta:
            return sum(n for n, _ in self.choices.values())
        return sum(len(o.token_ids) for o in out.outputs)

    def _final(self, out: Any, now: float, first: float | None, times: Any) -> None:
        counts = [len(o.token_ids) for o in out.outputs]
        if not any(counts):
            return
        self.metrics.first_token((first if first is not None else now) - self.t0)
        last = self._engine_time(times.last_token_time if times is not None else None, now)
        longest = max(counts)
        if first is None or last is None or longest < 2:
            return
        gap = (last - first) / (longest - 1)
        for k in counts:
            self.metrics.inter_token(gap, k - 1)
