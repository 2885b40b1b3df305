"""Long-running server hygiene: many requests of every kind and many adapter load/unload cycles
under fresh names leave no per-request or per-name state behind (locks, counters, metric series,
streams, file descriptors)."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from plugin_support import engine_config, wait_until

ADMIN = {"Authorization": "Bearer adm"}
HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path, adapter_root: Path) -> Iterator[Any]:
    from litestar import Litestar
    from litestar.testing import TestClient

    from lorastar.plugin import LoraStarConfig, LoraStarPlugin

    plugin = LoraStarPlugin(
        LoraStarConfig(
            engine=engine_config(tiny_model_dir, num_kv_blocks=128),
            served_model_name="tiny",
            adapters={"alpha": str(adapter_root / "alpha")},
            adapter_root=adapter_root,
            admin_token="adm",
        )
    )
    with TestClient(Litestar(plugins=[plugin])) as c:
        c.plugin = plugin  # type: ignore[attr-defined]
        yield c


def _requests(c: Any) -> None:
    """One request of each kind: plain, streamed, n > 1, structured, tools, stop + logprobs, and 400s."""
    for body, path, status in (
        ({"model": "tiny", "prompt": "a b", "max_tokens": 3}, "/v1/completions", 200),
        ({"model": "alpha", "prompt": "a b", "max_tokens": 3, "stream": True}, "/v1/completions", 200),
        ({"model": "tiny", "messages": HI, "max_tokens": 3, "n": 2}, "/v1/chat/completions", 200),
        (
            {"model": "tiny", "messages": HI, "max_tokens": 3, "n": 2, "stream": True},
            "/v1/chat/completions",
            200,
        ),
        (
            {"model": "tiny", "messages": HI, "max_tokens": 3, "response_format": {"type": "json_object"}},
            "/v1/chat/completions",
            200,
        ),
        (
            {"model": "tiny", "messages": HI, "max_tokens": 3, "tools": [TOOL], "tool_choice": "required"},
            "/v1/chat/completions",
            200,
        ),
        (
            {"model": "tiny", "prompt": "a b", "max_tokens": 3, "stop": ["x"], "logprobs": 2, "echo": True},
            "/v1/completions",
            200,
        ),
        ({"model": "tiny", "messages": HI, "max_tokens": 3, "temperature": -1}, "/v1/chat/completions", 400),
        ({"model": "tiny", "prompt": "a", "max_tokens": 100000}, "/v1/completions", 400),
        ({"model": "nope", "prompt": "a", "max_tokens": 3}, "/v1/completions", 404),
    ):
        r = c.post(path, json=body)
        assert r.status_code == status, (body, r.text)


def _cycle(c: Any, name: str) -> None:
    """Load ``name``, serve one request on it, unload it; and a failed load of another new name."""
    r = c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "beta"}, headers=ADMIN)
    assert r.status_code == 200, r.text
    r = c.post("/v1/completions", json={"model": name, "prompt": "a b", "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = c.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=ADMIN)
    assert r.status_code == 200, r.text
    bad = {"lora_name": f"{name}-bad", "lora_path": "alpha/adapter_config.json"}  # a file, not a folder
    r = c.post("/v1/load_lora_adapter", json=bad, headers=ADMIN)
    assert r.status_code == 400, r.text


def _sizes(c: Any) -> dict[str, int]:
    service = c.plugin.service
    engine = service.engine  # AsyncLLM
    core = engine.engine
    gc.collect()
    return {
        "streams": len(engine._streams),
        "open": len(engine._open),
        "adding": len(engine._adding) + len(engine._aborted_adding),
        "requests": len(core.requests),
        "output_processor": len(core.output_processor.requests),
        "seq_hashes": len(core.block_manager._seq_hashes),
        "adapter_locks": len(service._adapter_locks),
        "adapter_created": len(service.adapter_created),
        "fds": len(os.listdir("/proc/self/fd")),
    }


def test_requests_and_adapter_cycles_leave_nothing_behind(client: Any) -> None:
    """A structure that grows with the number of requests or of adapter names is a leak: after
    warm-up, 4 more rounds of requests and load/unload cycles under fresh names leave every size
    where it was (the per-name locks of the admin route grew by one per name before)."""
    _requests(client)  # warm-up: lazy imports, the grammar compiler, executor threads
    _cycle(client, "warm")
    engine = client.plugin.service.engine
    assert wait_until(lambda: not engine.has_unfinished(), 10)
    base = _sizes(client)
    for i in range(4):
        _requests(client)
        _cycle(client, f"cyc{i}")
    assert wait_until(lambda: not engine.has_unfinished(), 10)
    after = _sizes(client)
    assert after.pop("fds") <= base.pop("fds")  # (other tests' sockets may close meanwhile)
    assert after == base
    assert base["streams"] == base["requests"] == base["output_processor"] == base["adapter_locks"] == 0
    engine.engine.check_invariants()


def test_an_unloaded_adapter_leaves_no_metric_series_or_counter(client: Any) -> None:
    """vLLM keeps no series of an unloaded adapter (``lora_requests_info`` is one gauge): the
    per-adapter counters' series and the engine's per-name token counter go with the name, else
    each name ever served stays in every scrape and in every core State message for good."""
    for i in range(3):
        _cycle(client, f"gone{i}")
    r = client.post("/v1/completions", json={"model": "alpha", "prompt": "a b", "max_tokens": 2})
    assert r.status_code == 200, r.text
    text = client.get("/metrics").text
    assert 'adapter="alpha"' in text  # a loaded adapter keeps its series
    assert 'adapter="gone' not in text
    core = client.plugin.service.engine.engine
    assert "alpha" in core.adapter_tokens and not any(n.startswith("gone") for n in core.adapter_tokens)


def test_an_adapter_unloaded_while_its_request_runs_drops_its_counter(
    tiny_model_dir: Path, adapter_root: Path
) -> None:
    """The engine's per-name token counter of a name unloaded mid-request goes when that request ends."""
    from lorastar.engine.engine import LLMEngine
    from lorastar.engine.sampling import SamplingParams

    eng = LLMEngine(engine_config(tiny_model_dir, num_kv_blocks=32))
    eng.load_adapter("mid", str(adapter_root / "beta"))
    eng.add_request("a b c", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), adapter="mid")
    eng.step()
    eng.step()
    assert eng.adapter_tokens.get("mid", 0) > 0
    eng.unload_adapter("mid")
    while eng.has_unfinished():
        eng.step()
    assert "mid" not in eng.adapter_tokens and not eng.requests
    eng.check_invariants()
