"""/metrics values against vLLM v1's (vllm/v1/metrics/stats.py, loggers.py): what the counters count
and when, beyond the names and types that test_router_metrics.py checks."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from plugin_fake_engine import FakeAsyncLLM
from plugin_support import ServerThread, engine_config
from prometheus_client.parser import text_string_to_metric_families

from lorastar.engine.sampling import SamplingParams
from lorastar.plugin import LoraStarConfig, create_app

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Any]:
    """One sequence at a time: a second request waits while the first runs."""
    from lorastar.engine.engine import LLMEngine

    eng = LLMEngine(engine_config(tiny_model_dir, max_num_seqs=1))
    yield eng
    eng.close()


def run_to_end(eng: Any) -> None:
    while eng.has_unfinished():
        eng.step()


def test_prompt_tokens_count_when_the_prefill_is_done(engine: Any) -> None:
    """vLLM counts a request's prompt tokens with its first token (IterationStats.update_from_output):
    a running request's prompt shows before it ends, and one aborted before it ran adds none."""
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    before = engine.stats().prompt_tokens_total
    running = engine.add_request(list(range(10, 30)), params)  # 20 prompt tokens
    waiting = engine.add_request(list(range(40, 57)), params)  # 17, queued behind it
    engine.step()
    s = engine.stats()
    assert (s.num_running, s.num_waiting) == (1, 1)
    assert s.prompt_tokens_total - before == 20  # prefilled, not finished yet
    engine.abort_request(waiting.request_id)  # never scheduled: its prompt was not processed
    assert engine.stats().prompt_tokens_total - before == 20
    run_to_end(engine)
    s = engine.stats()
    assert s.prompt_tokens_total - before == 20  # not counted again at the end
    assert (s.num_running, s.num_waiting, s.kv_cache_usage) == (0, 0, 0.0)
    assert engine.requests == {} and running.is_finished


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    with ServerThread(create_app(LoraStarConfig(async_engine=FakeAsyncLLM()))) as srv:
        yield srv.url


def families(url: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}


def test_request_success_has_each_finished_reason_from_the_start(fake_url: str) -> None:
    """vLLM creates ``request_success_total{finished_reason}`` for every reason at 0 (loggers.py):
    a series that first appears at 1 hides that request from ``rate()`` / ``increase()``."""
    fams = families(fake_url)
    zero = {
        s.labels["finished_reason"]: s.value
        for s in fams["vllm:request_success"].samples
        if s.name == "vllm:request_success_total"
    }
    assert {r: zero.get(r) for r in ("stop", "length", "abort")} == {"stop": 0, "length": 0, "abort": 0}
    r = httpx.post(fake_url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    assert r.status_code == 200, r.text
    after = {
        s.labels["finished_reason"]: s.value
        for s in families(fake_url)["vllm:request_success"].samples
        if s.name == "vllm:request_success_total"
    }
    assert after["length"] == zero["length"] + 1 and after["stop"] == zero["stop"]


def test_grafana_dashboard_filters_only_on_labels_the_metrics_carry(fake_url: str) -> None:
    """A matcher on a label the metric lacks selects nothing (Grafana's "All" is ``(a|b)``, which
    the empty label does not match): ``vllm:lora_requests_info`` has no ``model_name`` (vLLM's too)."""
    httpx.post(fake_url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2})  # histograms
    labels: dict[str, set[str]] = {}
    for f in families(fake_url).values():
        for s in f.samples:
            labels.setdefault(f.name, set()).update(s.labels)
    dash = json.loads((REPO / "examples" / "grafana" / "lorastar.json").read_text())
    for expr in (t["expr"] for p in dash["panels"] for t in p["targets"]):
        for name, matchers in re.findall(r"((?:vllm|lorastar):[a-z_]+)\{([^}]*)\}", expr):
            family = re.sub(r"_(total|bucket|sum|count)$", "", name)
            for label in re.findall(r"([a-z_]+)\s*=~?", matchers):
                assert label in labels[family], (expr, label)
