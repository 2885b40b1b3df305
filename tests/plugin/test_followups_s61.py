"""Follow-ups: ``/v1/messages`` answers overload with Anthropic's 529 (the OpenAI routes keep 503);
``lorastar engine`` logs the periodic stats line of its core, as ``lorastar serve`` does."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from plugin_fake_engine import FakeAsyncLLM, FakeStats
from plugin_support import ServerThread, free_port

from lorastar.errors import EngineOverloadedError
from lorastar.plugin import LoraStarConfig, create_app

# ---- 1. Anthropic's 529 for overload -----------------------------------------------------------


@pytest.fixture(scope="module")
def overloaded() -> Iterator[tuple[httpx.Client, FakeAsyncLLM]]:
    engine = FakeAsyncLLM()
    with ServerThread(create_app(LoraStarConfig(async_engine=engine))) as srv:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            yield c, engine


def test_messages_overload_is_529_with_retry_after_openai_routes_keep_503(
    overloaded: tuple[httpx.Client, FakeAsyncLLM],
) -> None:
    http, engine = overloaded
    engine.fail_on_submit = EngineOverloadedError("waiting queue is full (max_waiting=1)")
    msgs = [{"role": "user", "content": "hi"}]
    try:
        for stream in (False, True):
            r = http.post("/v1/messages", json={"model": "fake-model", "max_tokens": 4, "messages": msgs,
                                                "stream": stream})  # fmt: skip
            assert r.status_code == 529, r.text
            assert r.headers["retry-after"] == "1"
            body = r.json()
            assert body["type"] == "error" and body["error"]["type"] == "overloaded_error", body
            assert "max_waiting" in body["error"]["message"]
            r = http.post("/v1/chat/completions", json={"model": "fake-model", "messages": msgs,
                                                        "stream": stream})  # fmt: skip
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == 503
    finally:
        engine.fail_on_submit = None
    # a restarting engine stays 503 on both (unavailable, not overloaded)
    engine.restarting = True
    try:
        r = http.post("/v1/messages", json={"model": "fake-model", "max_tokens": 4, "messages": msgs})
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error", r.text
    finally:
        engine.restarting = False
    paths = http.get("/schema/openapi.json").json()["paths"]
    assert "529" in paths["/v1/messages"]["post"]["responses"]
    assert "529" not in paths["/v1/chat/completions"]["post"]["responses"]
    assert "503" in paths["/v1/chat/completions"]["post"]["responses"]


# ---- 2. the stats line of `lorastar engine` ---------------------------------------------------------


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.levelno, record.getMessage()))

    def stats(self) -> list[tuple[int, str]]:
        return [(lv, m) for lv, m in list(self.messages) if "Avg generation throughput" in m]


class _BusyEngine:
    def __init__(self) -> None:
        self.n = 0

    def stats(self) -> FakeStats:  # tokens flow: each snapshot 10 more
        self.n += 10
        return FakeStats(prompt_tokens_total=self.n, generation_tokens_total=self.n, num_running=1)


@pytest.fixture
def lines() -> Iterator[_Lines]:
    log, handler = logging.getLogger("lorastar"), _Lines()
    level, propagate = log.level, log.propagate
    log.addHandler(handler)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def _stats_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "lorastar-stats-log"]


@pytest.mark.parametrize("disable", [False, True])
def test_engine_logs_the_stats_line_of_its_core_unless_disabled(
    disable: bool, lines: _Lines, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lorastar.engine.core_proc as core_proc
    import lorastar.plugin.stats_log as stats_log
    from lorastar.plugin.cli import main

    intervals: list[float] = []
    real = stats_log.start_stats_thread

    def fast(interval: float, stats: Any) -> Any:
        intervals.append(interval)
        return real(0.01, stats)

    class Core:  # stands in for EngineCoreProc: steps until the stats line came (or a moment passed)
        def __init__(self, config: Any, address: str, report_to: str | None = None) -> None:
            self.engine = _BusyEngine()
            self.restarting = False

        def run(self) -> None:
            deadline = time.monotonic() + (0.2 if disable else 5.0)
            while time.monotonic() < deadline and not lines.stats():
                time.sleep(0.01)
            raise KeyboardInterrupt  # Ctrl-C

    monkeypatch.setattr(stats_log, "start_stats_thread", fast)
    monkeypatch.setattr(core_proc, "EngineCoreProc", Core)
    args = ["engine", "--device", "cpu", "--address", f"tcp://127.0.0.1:{free_port()}"]
    r = CliRunner().invoke(main, [*args, *(["--disable-log-stats"] if disable else [])])
    assert r.exit_code == 0, r.output
    if disable:
        assert intervals == [] and lines.stats() == []
    else:
        assert intervals == [10.0]  # serve's interval
        level, msg = lines.stats()[0]
        assert level == logging.INFO and msg.startswith("Avg prompt throughput: "), msg
        assert "Running: 1 reqs, Waiting: 0 reqs, KV cache usage: 0.0%" in msg
    assert not _stats_threads()  # stopped with the core: nothing left running


def test_the_stats_thread_skips_a_restart_and_survives_a_failing_snapshot(lines: _Lines) -> None:
    from lorastar.plugin.stats_log import start_stats_thread

    logging.getLogger("lorastar").setLevel(logging.DEBUG)
    engine = _BusyEngine()
    calls = {"n": 0}

    def stats() -> FakeStats | None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        if calls["n"] == 3:
            return None  # restarting: counters start again
        return engine.stats()

    stop = start_stats_thread(0.01, stats)
    try:
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not lines.stats():
            time.sleep(0.01)
    finally:
        stop()
    assert calls["n"] >= 5  # a line needs two snapshots after the restart (calls 4 and 5)
    assert any("stats for the log line failed" in m for _, m in lines.messages)
    assert lines.stats() and not _stats_threads()
