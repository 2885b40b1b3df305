"""The plugin with its engine core in a process of its own (``LoraStarConfig(engine_process=True)``):
the same routes answer the same, checked against the offline ``LLM`` on the same weights and adapters."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from plugin_support import ServerThread, engine_config, wait_until

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, adapter_root: Path) -> Iterator[Any]:
    from lorastar.plugin import LoraStarConfig, LoraStarPlugin, create_app

    config = LoraStarConfig(
        engine=engine_config(tiny_model_dir),
        served_model_name="tiny",
        adapters={"alpha": str(adapter_root / "alpha")},
        adapter_root=adapter_root,
        admin_token="admin-secret",
        engine_process=True,
    )
    app = create_app(config)
    with ServerThread(app) as srv:
        srv.plugin = app.plugins.get(LoraStarPlugin)  # type: ignore[attr-defined]
        yield srv


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, adapter_root: Path) -> Any:
    from lorastar import LLM

    llm = LLM(config=engine_config(tiny_model_dir))
    llm.load_adapter("alpha", str(adapter_root / "alpha"))
    llm.load_adapter("gamma", str(adapter_root / "gamma"))
    return llm


def _greedy(n: int = 12) -> Any:
    from lorastar import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n)


def test_engine_runs_in_another_process(server: Any) -> None:
    import os

    from lorastar.engine.core_client import AsyncCoreClient

    engine = server.plugin.engine
    assert isinstance(engine, AsyncCoreClient) and engine.core_pid not in (None, os.getpid())
    assert httpx.get(server.url + "/health").status_code == 200
    from lorastar.plugin.startup_log import startup_lines

    lines = startup_lines(engine, "tiny")  # the core's summary, computed where the engine is
    assert lines[0] == "Serving model 'tiny'" and any(
        line.startswith("KV cache: 512 blocks") for line in lines
    )
    stats = httpx.get(server.url + "/lorastar/stats").json()  # the operator page's header
    assert stats["device"] == "cpu" and stats["dtype"] == "float32" and stats["block_size"] == 16
    assert stats["max_model_len"] == engine.max_model_len


@pytest.mark.parametrize("model", ["tiny", "alpha"])
def test_completions_stream_and_not_equal_llm_generate(server: Any, reference: Any, model: str) -> None:
    want = reference.generate(PROMPT, _greedy(), adapter=None if model == "tiny" else model)[0].outputs[0]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    got = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert got["choices"][0]["text"] == want.text and got["usage"]["completion_tokens"] == len(want.token_ids)
    frames = httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=60).text
    chunks = [json.loads(f[6:]) for f in frames.split("\n\n") if f.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want.text


def test_bad_requests_get_their_4xx(server: Any) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "n": 10_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # refused in the core, typed here
    r = httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404


def test_tokenize_and_detokenize(server: Any, reference: Any) -> None:
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": PROMPT}).json()
    assert r["tokens"] == reference.engine.tokenize(PROMPT) and r["max_model_len"] == 256
    r = httpx.post(server.url + "/detokenize", json={"model": "tiny", "tokens": r["tokens"]}).json()
    assert r["prompt"] == PROMPT


def test_runtime_adapter_load_serves_and_shows_in_models_and_metrics(server: Any, reference: Any) -> None:
    admin = {"Authorization": "Bearer admin-secret"}
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": "gamma"},
                   headers=admin, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    assert "gamma" in [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
    want = reference.generate(PROMPT, _greedy(), adapter="gamma")[0].outputs[0].text
    body = {"model": "gamma", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    assert (
        httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == want
    )
    metrics = httpx.get(server.url + "/metrics").text
    assert 'vllm:generation_tokens_total{model_name="tiny"}' in metrics
    engine = server.plugin.engine
    assert wait_until(lambda: engine.stats().num_running == 0 and engine.stats().num_used_blocks == 0)
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "gamma"}, headers=admin)
    assert r.status_code == 200 and "gamma" not in [a.name for a in engine.list_adapters()]


def test_startup_cancelled_while_waiting_for_a_shared_core_stops_quietly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Ctrl-C while the app's startup waits for a shared core that is not there (``lorastar serve``'s
    signal handler calls ``cancel_startup``): the startup ends at once with one log line, no
    traceback, and the app shuts down normally."""
    import logging
    import threading
    import time

    from litestar.testing import TestClient

    from lorastar.engine import core_client
    from lorastar.plugin import LoraStarConfig, LoraStarPlugin, create_app

    config = LoraStarConfig(engine=engine_config(tiny_model_dir), engine_address=f"ipc://{tmp_path}/none")
    app = create_app(config)

    def cancel() -> None:
        deadline = time.monotonic() + 30
        while core_client.cancel_startup() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)

    canceller = threading.Thread(target=cancel, daemon=True)
    canceller.start()
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log, keep = logging.getLogger("lorastar.plugin"), Keep()
    log.addHandler(keep)
    t0 = time.monotonic()
    try:
        with TestClient(app):
            assert not app.plugins.get(LoraStarPlugin).service.started
    finally:
        log.removeHandler(keep)
    canceller.join(5)
    assert time.monotonic() - t0 < 20  # not the 60 s connect timeout
    assert any("stopped while waiting for the engine core" in r.getMessage() for r in records)
