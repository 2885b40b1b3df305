"""``serve`` / ``run-batch --engine-address``: the shared core keeps the model and engine settings
``lorastar engine`` was started with, so engine flags and MODEL given to the app worker have no
effect. They used to be dropped in silence; now each one given on the command line is named in a
warning (a --config file the core and its workers share stays quiet)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from lorastar.plugin import cli
from lorastar.plugin.cli import main

ADDR = "ipc:///nowhere"


@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "run_server", lambda app, sock, level, **kw: sock.close())


def _serve(*args: str) -> Any:
    return CliRunner().invoke(main, ["serve", "--port", "0", "--engine-address", ADDR, *args])


def test_engine_flags_with_an_engine_address_are_named(no_server: None, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    r = _serve(str(tmp_path), "--max-num-seqs", "8", "--kv-cache-dtype", "fp8", "--served-model-name", "m")
    assert r.exit_code == 0, r.output
    assert (
        f"lorastar: MODEL, --max-num-seqs, --kv-cache-dtype ignored: the engine core at --engine-address {ADDR}"
        in r.output
    )
    r = _serve("--model", str(tmp_path), "--scheduling-policy", "priority")
    assert "lorastar: --model, --scheduling-policy ignored" in r.output, r.output


def test_app_flags_defaults_and_a_shared_config_file_stay_quiet(no_server: None, tmp_path: Path) -> None:
    for args in (
        (),
        ("--served-model-name", "m", "--max-waiting", "9", "--disable-log-stats", "--trust-remote-code"),
    ):
        r = _serve(*args)
        assert r.exit_code == 0, r.output
        assert "ignored" not in r.output, r.output
    config = tmp_path / "shared.yaml"
    config.write_text("max-num-seqs: 8\nscheduling-policy: priority\n")
    r = _serve("--config", str(config))
    assert r.exit_code == 0 and "ignored" not in r.output, r.output


def test_without_an_engine_address_nothing_is_said(no_server: None, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    r = CliRunner().invoke(main, ["serve", str(tmp_path), "--port", "0", "--max-num-seqs", "8"])
    assert r.exit_code == 0, r.output
    assert "ignored" not in r.output
