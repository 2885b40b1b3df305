"""The periodic stats line (vLLM's ``LoggingStatLogger``): ``lorastar serve`` logs one every 10 s
unless ``--disable-log-stats``; an app that mounts the plugin asks for it with
``LoraStarConfig.log_stats_interval``."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from plugin_fake_engine import FakeStats

from lorastar.plugin import LoraStarConfig
from lorastar.plugin.stats_log import StatsLine


def test_the_line_reports_the_interval_as_vllm_and_goes_quiet_when_idle() -> None:
    line = StatsLine()
    assert line.update(FakeStats(), 100.0) is None  # no interval yet
    busy = FakeStats(
        prompt_tokens_total=1000, generation_tokens_total=200, prefix_cache_queries=800,
        prefix_cache_hits=300, num_running=16, num_waiting=2, kv_cache_usage=0.412,
        adapters={"a": {"running": 3, "waiting": 0}, "b": {"running": 0, "waiting": 1}},
        adapter_tiers={"a": "device", "b": "cpu", "c": "disk"},
    )  # fmt: skip
    level, msg = line.update(busy, 110.0)  # type: ignore[misc]
    assert level == logging.INFO
    assert msg == (
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 20.0 tokens/s, "
        "Running: 16 reqs, Waiting: 2 reqs, KV cache usage: 41.2%, Prefix cache hit rate: 37.5%, "
        "Adapters: 1 running / 3 loaded"
    )
    idle = FakeStats(prompt_tokens_total=1000, generation_tokens_total=200, prefix_cache_queries=800)
    level, msg = line.update(idle, 120.0)  # type: ignore[misc]
    # the first idle interval still at INFO (the throughput fell to 0), then DEBUG
    assert level == logging.INFO and "Avg generation throughput: 0.0 tokens/s" in msg
    assert "Prefix cache hit rate: 0.0%" in msg and "Adapters" not in msg
    assert line.update(idle, 130.0)[0] == logging.DEBUG  # type: ignore[index]
    assert line.update(FakeStats(generation_tokens_total=5), 131.0) is None  # counters restarted


@pytest.mark.parametrize("bad", [0, -1, True, "10"])
def test_a_bad_interval_is_refused_naming_it(bad: Any) -> None:
    with pytest.raises(ValueError, match="log_stats_interval"):
        LoraStarConfig(log_stats_interval=bad)


class _Lines(logging.Handler):
    """The messages of the ``lorastar`` logger (Litestar's start replaces the root's handlers, and
    caplog's with them)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.levelno, record.getMessage()))


def test_a_served_app_logs_the_line_while_it_generates(tiny_model_dir: Any) -> None:
    from litestar.testing import TestClient

    from lorastar.plugin import create_app
    from tests.plugin.plugin_support import engine_config, wait_until

    cfg = LoraStarConfig(engine=engine_config(tiny_model_dir), log_stats_interval=0.05)
    log, lines = logging.getLogger("lorastar"), _Lines()
    level = log.level
    log.addHandler(lines)
    log.setLevel(logging.DEBUG)
    try:

        def logged() -> list[tuple[int, str]]:
            return [(lv, m) for lv, m in lines.messages if "Avg generation throughput" in m]

        with TestClient(create_app(cfg)) as c:
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 40, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert wait_until(lambda: any(lv == logging.DEBUG for lv, _ in logged()))  # then idle
            generating = [lv for lv, m in logged() if "Avg generation throughput: 0.0 " not in m]
            assert generating and set(generating) == {logging.INFO}, logged()
        n = len(logged())  # none once the app stopped
        assert wait_until(lambda: len(logged()) > n, timeout=0.3) is False
    finally:
        log.removeHandler(lines)
        log.setLevel(level)


def test_serve_logs_it_every_10_s_unless_disable_log_stats(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    import lorastar.plugin.cli as cli

    seen: list[Any] = []

    def fake_run(app: Any, sock: Any, log_level: str) -> None:
        seen.append(app.plugins.get("LoraStarPlugin").config)
        sock.close()

    monkeypatch.setattr(cli, "run_server", fake_run)
    for extra, want in (([], 10.0), (["--disable-log-stats"], None)):
        result = CliRunner().invoke(cli.main, ["serve", "--port", "0", *extra])
        assert result.exit_code == 0, result.output
        assert seen[-1].log_stats_interval == want
