"""``log_requests`` / ``--enable-log-requests`` (vLLM's): one ``Received request`` line per engine
request (prompt and ids cut at ``max_log_len``), then ``Finished`` or ``Aborted``; off by default."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from plugin_support import ServerThread, engine_config, serve_config

PROMPT = "The capital of France is a city"


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def lines() -> Iterator[list[str]]:
    """What ``lorastar.requests`` logs (its own handler: another test may have stopped propagation)."""
    log = logging.getLogger("lorastar.requests")
    handler, level = Lines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield handler.lines
    log.removeHandler(handler)
    log.setLevel(level)


@pytest.fixture(scope="module")
def logging_server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    from litestar import Litestar

    from lorastar.plugin import LoraStarConfig, LoraStarPlugin

    config = LoraStarConfig(
        engine=engine_config(tiny_model_dir), served_model_name="tiny", log_requests=True, max_log_len=12
    )
    with ServerThread(Litestar(plugins=[LoraStarPlugin(config)])) as srv:
        yield srv


def test_received_and_finished(logging_server: ServerThread, lines: list[str], tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok(PROMPT)["input_ids"]
    assert len(ids) > 5
    r = httpx.post(
        logging_server.url + "/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True},
        headers={"X-Request-Id": "log-1"},
    )
    assert r.status_code == 200
    received = [x for x in lines if x.startswith("Received request cmpl-log-1-")]
    finished = [x for x in lines if x.startswith("Finished request cmpl-log-1-")]
    assert len(received) == 1 and len(finished) == 1, lines
    # max_log_len 12: 12 characters of the prompt's text and 12 ids at most
    want_ids = ids[:12]
    assert f"prompt {tok.decode(want_ids)[:12]!r}, prompt_token_ids {want_ids}, params " in received[0]
    assert "model 'tiny'" in received[0] and "max_tokens=3" in received[0]
    assert re.fullmatch(
        rf"Finished request cmpl-log-1-\S+: length, {len(ids)} prompt tokens, 3 output tokens, \d+\.\d{{3}} s",
        finished[0],
    ), finished[0]


def test_a_consumer_that_leaves_is_logged_as_aborted(tiny_model_dir: Path, lines: list[str]) -> None:
    """The stream closed after its first output (a client gone): ``Aborted``, never ``Finished``."""
    from lorastar import SamplingParams
    from lorastar.plugin import LoraStarConfig
    from lorastar.plugin.service import LoraStarService

    async def run() -> None:
        service = LoraStarService(
            LoraStarConfig(engine=engine_config(tiny_model_dir), served_model_name="tiny", log_requests=True)
        )
        await service.start()
        try:
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            gen = service.generate(PROMPT, params, None, "gone-1")
            first = await gen.__anext__()
            assert not first.finished
            await gen.aclose()
        finally:
            await service.stop()

    asyncio.run(run())
    assert lines[0].startswith(
        f"Received request gone-1: model 'tiny', prompt {PROMPT!r}, prompt_token_ids None"
    )
    assert lines[1:] == ["Aborted request gone-1: the client went away"]


def test_off_by_default(real_server: Any, lines: list[str]) -> None:
    r = httpx.post(
        real_server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}
    )
    assert r.status_code == 200 and lines == []


def test_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from lorastar.plugin import LoraStarConfig

    (tmp_path / "config.json").write_text("{}")
    r, config = serve_config(
        monkeypatch, [str(tmp_path), "--port", "0", "--enable-log-requests", "--max-log-len", "7"]
    )
    assert r.exit_code == 0, r.output
    assert config.log_requests and config.max_log_len == 7
    r, _ = serve_config(monkeypatch, [str(tmp_path), "--port", "0", "--max-log-len", "-1"])
    assert r.exit_code == 2 and "--max-log-len" in r.output
    with pytest.raises(ValueError, match="max_log_len"):
        LoraStarConfig(max_log_len=-1)
