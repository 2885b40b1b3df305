"""Review of today's combinations: ``lorastar run-batch --engine-address`` when the core is absent."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from lorastar.plugin.cli import main


def _batch(tmp_path: Path) -> Path:
    batch = tmp_path / "batch.jsonl"
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 2}
    batch.write_text(
        json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}) + "\n",
        encoding="utf-8",
    )
    return batch


pytestmark = pytest.mark.usefixtures("restore_lorastar_logger")


def test_run_batch_engine_address_with_no_core_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run-batch --engine-address ADDR`` with no ``lorastar engine`` there: the client gives up after
    its connect timeout (60 s) with a ConnectionError that names the fix. run-batch lets it out as
    an ExceptionGroup traceback (~90 lines) instead of ``Error: cannot start: no engine core at ...``
    (only ValueError is turned into a usage error). The 60 s wait is replaced by an immediate raise."""
    from lorastar.plugin import service

    def no_core(config: Any, address: str | None) -> Any:
        raise ConnectionError(f"no engine core at {address}: nothing accepted a connection in 60 s")

    monkeypatch.setattr(service, "build_core_client", no_core)
    batch = _batch(tmp_path)
    out = tmp_path / "out.jsonl"
    r = CliRunner().invoke(
        main, ["run-batch", "-i", str(batch), "-o", str(out), "--engine-address", "tcp://127.0.0.1:9"]
    )
    assert isinstance(r.exception, SystemExit), f"a traceback, not an error line: {r.exception!r}"
    assert r.exit_code != 0
    assert "no engine core at tcp://127.0.0.1:9" in r.output


def test_run_batch_sigterm_ends_the_wait_for_an_engine_core(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM (or Ctrl-C) while run-batch waits for the core at ``--engine-address``: serve ends
    that wait (``core_client.cancel_startup()`` in its signal handler), run-batch does not, so the
    process sits until the 60 s connect timeout. The fake core client waits as the real one does
    (an Event in ``core_client._waiting``) and records whether anything ended its wait."""
    from lorastar.engine import core_client
    from lorastar.plugin import service

    cancelled: list[bool] = []

    def waiting_client(config: Any, address: str | None) -> Any:
        ev = threading.Event()
        with core_client._waiting_lock:
            core_client._waiting.add(ev)
        # run-batch's SIGTERM handler is in place by now (the app's start-up is running)
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        try:
            cancelled.append(ev.wait(8.0))
        finally:
            with core_client._waiting_lock:
                core_client._waiting.discard(ev)
        raise ConnectionError(f"no engine core at {address}")

    monkeypatch.setattr(service, "build_core_client", waiting_client)
    r = CliRunner().invoke(
        main,
        [
            "run-batch",
            "-i",
            str(_batch(tmp_path)),
            "-o",
            str(tmp_path / "o.jsonl"),
            "--engine-address",
            "tcp://127.0.0.1:9",
        ],  # fmt: skip
    )
    assert r.exit_code != 0, r.output
    assert cancelled == [True], "SIGTERM did not end the wait for the engine core (cancel_startup)"
