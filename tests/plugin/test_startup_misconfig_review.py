"""Start-up misconfiguration of ``lorastar serve`` / ``lorastar engine`` / ``LLM`` / ``EngineConfig``:
what only the model can refuse (``--max-model-len`` past its positions, ``--quantization`` it lacks)
is one ``Error:`` line and exit 2, as the checks made before the model loads, never a traceback."""

from __future__ import annotations

import json
import re
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from plugin_support import free_port

from lorastar.config import EngineConfig
from lorastar.plugin.cli import main

FAST = ["--device", "cpu", "--cpu-kernels", "torch", "--cpu-gemm", "torch"]


@pytest.fixture
def shipped_run_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``run_server`` as shipped, with uvicorn's logging and the signal handlers left as they were."""
    import uvicorn

    config = uvicorn.Config
    monkeypatch.setattr(uvicorn, "Config", lambda app, **kw: config(app, log_config=None, **kw))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _one_line(r: Any, text: str) -> None:
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    errors = [line for line in r.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and text in errors[0], r.output
    assert "Traceback" not in r.output and r.output.endswith(errors[0] + "\n"), r.output


def test_serve_model_refusing_the_options_is_one_line_and_frees_the_port(
    tiny_model_dir: Path, shipped_run_server: None
) -> None:
    # Was uvicorn's 60-line ExceptionGroup traceback ("Application startup failed"), exit 3.
    args = [
        "serve",
        str(tiny_model_dir),
        "--port",
        "0",
        "--no-engine-process",
        *FAST,
        "--max-model-len",
        "100000",
    ]
    r = CliRunner().invoke(main, args)
    _one_line(r, "cannot start: max_model_len (100000) exceeds the model's max_position_embeddings")
    port = int(re.search(r"listening on http://127\.0\.0\.1:(\d+)/", r.output).group(1))  # type: ignore[union-attr]
    with socket.socket() as s:  # nothing half-started: the listening socket is closed
        s.bind(("127.0.0.1", port))


def test_serve_startup_failure_that_is_no_config_error_keeps_its_report(
    monkeypatch: pytest.MonkeyPatch, shipped_run_server: None, tmp_path: Path
) -> None:
    import lorastar.plugin.service as service

    def broken(config: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(service, "build_engine", broken)
    (tmp_path / "config.json").write_text("{}")
    r = CliRunner().invoke(main, ["serve", str(tmp_path), "--port", "0", "--no-engine-process", *FAST])
    assert r.exit_code == 3, r.output  # uvicorn's report with the traceback, as before
    # (uvicorn's traceback goes to its log handler, bound to another stderr once the suite has run
    # other servers: only the exit code and the missing one-line error are checked)
    assert "Error: cannot start" not in r.output, r.output


def test_engine_model_refusing_the_options_is_one_line(tiny_model_dir: Path) -> None:
    # Was "the engine core failed to start" with a traceback, exit 1.
    args = ["engine", str(tiny_model_dir), "--address", f"tcp://127.0.0.1:{free_port()}", *FAST]
    r = CliRunner().invoke(main, [*args, "--max-model-len", "100000"])
    _one_line(r, "cannot start: max_model_len (100000) exceeds the model's max_position_embeddings")


@pytest.fixture
def adapter_folder(tmp_path: Path) -> Path:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "base_model_name_or_path": "x"}))
    return tmp_path


def test_adapter_given_as_the_base_model_says_so(
    adapter_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lorastar import LLM
    from lorastar.plugin import cli

    monkeypatch.setattr(cli, "run_server", lambda *a: pytest.fail("must not start"))
    r = CliRunner().invoke(main, ["serve", str(adapter_folder), "--port", "0"])
    _one_line(r, "has no config.json (it is a LoRA adapter: serve its base model")
    with pytest.raises(ValueError, match=r"has no config.json \(it is a LoRA adapter"):
        LLM(str(adapter_folder), device="cpu")


def test_chat_template_file_is_read_and_a_missing_one_refused(tmp_path: Path) -> None:
    # A path was used as the template text: every chat prompt was the path itself.
    tpl = tmp_path / "chat.jinja"
    tpl.write_text("{{ messages[0]['content'] }}")
    assert EngineConfig(chat_template=str(tpl)).chat_template == tpl.read_text()
    assert EngineConfig(chat_template=tpl).chat_template == tpl.read_text()  # type: ignore[arg-type]
    assert EngineConfig(chat_template="{{ 'inline' }}").chat_template == "{{ 'inline' }}"
    with pytest.raises(ValueError, match="^chat_template must be a Jinja template or a file"):
        EngineConfig(chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="^chat_template must be a Jinja template or a file"):
        EngineConfig(chat_template=5)  # type: ignore[arg-type]
