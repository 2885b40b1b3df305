"""/metrics as LoRA-aware routers read it: every name, type and label set that the Gateway API
Inference Extension's endpoint picker (llm-d) and vLLM's production-stack router read, parsed with
prometheus-client's own parser, and values that move with requests, evictions and unloads."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from plugin_support import ServerThread, engine_config
from prometheus_client.parser import text_string_to_metric_families

# name -> (type, label names). GIE / llm-d: waiting, running, kv_cache_usage_perc, cache_config_info,
# lora_requests_info. production-stack: running, waiting and the older gpu_* names. vLLM's request
# histograms and success counter (dashboards, autoscalers). lorastar: adapter residency by tier.
ROUTER_METRICS: dict[str, tuple[str, set[str]]] = {
    "vllm:num_requests_waiting": ("gauge", {"model_name"}),
    "vllm:num_requests_running": ("gauge", {"model_name"}),
    "vllm:kv_cache_usage_perc": ("gauge", {"model_name"}),
    "vllm:gpu_cache_usage_perc": ("gauge", {"model_name"}),
    "vllm:cache_config_info": (
        "gauge",
        {"block_size", "cache_dtype", "enable_prefix_caching", "num_cpu_blocks", "num_gpu_blocks"},
    ),
    "vllm:lora_requests_info": ("gauge", {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}),
    "vllm:prefix_cache_queries": ("counter", {"model_name"}),
    "vllm:prefix_cache_hits": ("counter", {"model_name"}),
    "vllm:gpu_prefix_cache_queries": ("counter", {"model_name"}),
    "vllm:gpu_prefix_cache_hits": ("counter", {"model_name"}),
    "vllm:gpu_prefix_cache_hit_rate": ("gauge", {"model_name"}),
    "vllm:request_success": ("counter", {"model_name", "finished_reason"}),
    "vllm:prompt_tokens": ("counter", {"model_name"}),
    "vllm:generation_tokens": ("counter", {"model_name"}),
    "vllm:request_prompt_tokens": ("histogram", {"model_name"}),
    "vllm:request_generation_tokens": ("histogram", {"model_name"}),
    "vllm:request_queue_time_seconds": ("histogram", {"model_name"}),
    "vllm:request_prefill_time_seconds": ("histogram", {"model_name"}),
    "vllm:request_decode_time_seconds": ("histogram", {"model_name"}),
    "vllm:request_inference_time_seconds": ("histogram", {"model_name"}),
    "vllm:iteration_tokens_total": ("histogram", {"model_name"}),
    "vllm:time_to_first_token_seconds": ("histogram", {"model_name"}),
    "vllm:inter_token_latency_seconds": ("histogram", {"model_name"}),
    "vllm:e2e_request_latency_seconds": ("histogram", {"model_name"}),
    "lorastar:lora_adapter_info": ("gauge", {"model_name", "adapter", "tier"}),
}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, adapter_root: Path) -> Iterator[ServerThread]:
    """One device slot (max_loras=1), so serving the second adapter evicts the first to the CPU."""
    from litestar import Litestar

    from lorastar.plugin import LoraStarConfig, LoraStarPlugin

    plugin = LoraStarPlugin(
        LoraStarConfig(
            engine=engine_config(tiny_model_dir, max_loras=1),
            served_model_name="tiny",
            adapters={"alpha": str(adapter_root / "alpha"), "beta": str(adapter_root / "beta")},
            adapter_root=adapter_root,
            admin_token="admin-secret",
        )
    )
    with ServerThread(Litestar(plugins=[plugin])) as srv:
        yield srv


def scrape(srv: ServerThread) -> dict[str, Any]:
    r = httpx.get(srv.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def sample(
    families: dict[str, Any], name: str, suffix: str = "", *, missing: float | None = None, **labels: str
) -> float:
    """The value of ``name + suffix`` whose labels include ``labels`` (exactly one must match;
    ``missing``: the value when there is none yet, a series not created before its first event)."""
    hits = [
        s.value
        for s in (families[name].samples if name in families else [])
        if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    if not hits and missing is not None:
        return missing
    assert len(hits) == 1, (name, suffix, labels, families[name].samples)
    return float(hits[0])


def complete(srv: ServerThread, model: str, **body: Any) -> httpx.Response:
    body = {
        "model": model,
        "prompt": "Hello there",
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        **body,
    }
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_every_router_metric_has_its_name_type_and_labels(server: ServerThread) -> None:
    complete(server, "tiny")  # every histogram gets a sample
    fams = scrape(server)
    for name, (kind, labels) in ROUTER_METRICS.items():
        assert name in fams, f"{name} missing"
        assert fams[name].type == kind, (name, fams[name].type)
        assert fams[name].samples, f"{name} has no sample"
        for s in fams[name].samples:
            assert set(s.labels) - {"le"} == labels, (name, s.labels)
    info = fams["vllm:cache_config_info"].samples[0]
    assert info.value == 1.0 and info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "512"
    lora = fams["vllm:lora_requests_info"].samples[0]
    assert lora.labels["max_lora"] == "1" and abs(lora.value - time.time()) < 60  # the newest series wins
    assert 0.0 <= sample(fams, "vllm:gpu_prefix_cache_hit_rate") <= 1.0
    assert sample(fams, "vllm:gpu_cache_usage_perc") == sample(fams, "vllm:kv_cache_usage_perc")


def test_counts_move_with_requests_and_residency_with_evictions(server: ServerThread) -> None:
    before = scrape(server)
    # A stream (DELTA outputs) of 5 tokens on alpha, then n = 2 on beta: two requests, 15 tokens.
    r = complete(server, "alpha", stream=True)
    assert r.text.rstrip().endswith("data: [DONE]")
    complete(server, "beta", n=2)
    after = scrape(server)

    def grew(name: str, suffix: str = "_total", **labels: str) -> float:
        return sample(after, name, suffix, **labels) - sample(before, name, suffix, missing=0.0, **labels)

    assert grew("vllm:request_success", finished_reason="length") == 2  # requests, not choices
    assert grew("vllm:request_generation_tokens", "_count") == 2
    assert grew("vllm:request_generation_tokens", "_sum") == 15
    assert grew("lorastar:adapter_generation_tokens", adapter="alpha") == 5
    assert grew("lorastar:adapter_generation_tokens", adapter="beta") == 10
    assert grew("vllm:time_to_first_token_seconds", "_count") == 2
    assert grew("vllm:request_queue_time_seconds", "_count") == 2
    assert grew("vllm:request_decode_time_seconds", "_count") == 2
    assert grew("vllm:iteration_tokens_total", "_count") >= 5  # one observation per engine step
    # One device slot: beta holds it, alpha went back to the CPU tier.
    held = {(s.labels["adapter"], s.labels["tier"]) for s in after["lorastar:lora_adapter_info"].samples}
    assert held == {("beta", "device"), ("alpha", "cpu")}
    assert after["vllm:lora_requests_info"].samples[0].labels["running_lora_adapters"] == "beta"
    complete(server, "alpha")
    held = {
        (s.labels["adapter"], s.labels["tier"]) for s in scrape(server)["lorastar:lora_adapter_info"].samples
    }
    assert held == {("alpha", "device"), ("beta", "cpu")}
    # Unloaded: gone from the residency metric.
    r = httpx.post(
        server.url + "/v1/unload_lora_adapter",
        json={"lora_name": "beta"},
        headers={"Authorization": "Bearer admin-secret"},
    )
    assert r.status_code == 200, r.text
    fams = scrape(server)
    assert {s.labels["adapter"] for s in fams["lorastar:lora_adapter_info"].samples} == {"alpha"}
    assert fams["vllm:lora_requests_info"].samples[0].labels["running_lora_adapters"] == "alpha"
