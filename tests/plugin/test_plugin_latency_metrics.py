"""TTFT and inter-token latency as vLLM defines them, on a fake engine with a known step time:
TTFT is the time to the request's first token (a non-streamed request's too, from the engine's
timestamps), ITL one observation per token after its choice's first, the gap since the same
choice's previous token."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from plugin_fake_engine import FakeAsyncLLM
from plugin_support import ServerThread
from prometheus_client.parser import text_string_to_metric_families

from lorastar.plugin import LoraStarConfig, create_app
from lorastar.plugin.metrics import PluginMetrics

STEP = 0.05  # the fake engine's time per token (a floor: asyncio.sleep never returns early)
TOKENS = 5
NAMES = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds")


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    app = create_app(LoraStarConfig(async_engine=FakeAsyncLLM(step_delay=STEP)))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


def latencies(http: httpx.Client) -> dict[str, float]:
    """``{name_sum, name_count}`` of the three latency histograms (0 before their first sample)."""
    out = {f"{n}{s}": 0.0 for n in NAMES for s in ("_sum", "_count")}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            short = s.name.removeprefix("vllm:")
            if short in out:
                out[short] = s.value
    return out


def measured(http: httpx.Client, **body: object) -> dict[str, float]:
    """What one completion adds to the latency histograms."""
    before = latencies(http)
    r = http.post("/v1/completions", json={"prompt": "abcdef", "max_tokens": TOKENS, **body})
    assert r.status_code == 200, r.text
    if body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
    after = latencies(http)
    return {k: after[k] - before[k] for k in after}


def test_a_non_streamed_request_times_its_first_token_and_each_gap(http: httpx.Client) -> None:
    d = measured(http)
    e2e = d["e2e_request_latency_seconds_sum"]
    assert d["time_to_first_token_seconds_count"] == 1
    # the first token came a step in, TOKENS - 1 steps before the end (not the whole request)
    assert 0 < d["time_to_first_token_seconds_sum"] <= e2e - (TOKENS - 2) * STEP
    # one gap per token after the first; together they span first to last token
    assert d["inter_token_latency_seconds_count"] == TOKENS - 1
    assert (TOKENS - 1.5) * STEP <= d["inter_token_latency_seconds_sum"] <= e2e


def test_n_choices_each_observe_their_own_gaps(http: httpx.Client) -> None:
    for body in ({"stream": True}, {}):  # streamed and whole
        d = measured(http, n=2, **body)
        assert d["time_to_first_token_seconds_count"] == 1, body  # per request, not per choice
        # per choice: TOKENS - 1 gaps of a step each (not one step shared by both choices' tokens)
        assert d["inter_token_latency_seconds_count"] == 2 * (TOKENS - 1), body
        assert d["inter_token_latency_seconds_sum"] >= 2 * (TOKENS - 1.5) * STEP, body
        assert d["inter_token_latency_seconds_sum"] <= 2 * d["e2e_request_latency_seconds_sum"], body


def test_inter_token_observes_every_token_exactly() -> None:
    m = PluginMetrics(lambda: None, lambda: "m", lambda: 1)
    m.inter_token(0.02, 100)  # 100 tokens 20 ms apart (once capped at 64, the gap split among them)
    m.inter_token(0.5, 0)  # no token: nothing
    get = m.registry.get_sample_value
    assert get("vllm:inter_token_latency_seconds_count", {"model_name": "m"}) == 100
    assert get("vllm:inter_token_latency_seconds_sum", {"model_name": "m"}) == pytest.approx(2.0)
    assert get("vllm:inter_token_latency_seconds_bucket", {"model_name": "m", "le": "0.01"}) == 0
    assert get("vllm:inter_token_latency_seconds_bucket", {"model_name": "m", "le": "0.025"}) == 100
    assert get("vllm:inter_token_latency_seconds_bucket", {"model_name": "m", "le": "+Inf"}) == 100
