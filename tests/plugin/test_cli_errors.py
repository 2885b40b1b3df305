"""Operator mistakes on ``lorastar engine``, ``lorastar serve`` and ``lorastar lora``: one ``Error:``
line and exit code 2 (usage) or 1 (the server said no), found before any model loads."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from click.testing import CliRunner
from plugin_fake_engine import FakeAsyncLLM
from plugin_support import ServerThread, free_port

from lorastar.plugin import LoraStarConfig, cli, create_app
from lorastar.plugin.cli import main

REPO = Path(__file__).resolve().parents[2]


def _one_line_usage_error(r: Any, text: str) -> None:
    assert r.exit_code == 2 and text in r.output and r.output.count("\n") == 1, r.output
    assert r.output.startswith("Error: "), r.output


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # ipc paths are limited to 107 bytes: pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="lsq") as d:
        yield Path(d)


class FakeCore:
    """Stands in for ``EngineCoreProc``: records its address and returns from ``run`` at once."""

    made: list[str] = []

    def __init__(self, config: Any, address: str, report_to: str | None = None) -> None:
        FakeCore.made.append(address)
        self.engine = object()  # engine_summary fails on it: the ready line must come anyway

    def run(self) -> None:
        pass


@pytest.fixture
def fake_core(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    import lorastar.engine.core_proc as core_proc

    FakeCore.made = []
    monkeypatch.setattr(core_proc, "EngineCoreProc", FakeCore)
    return FakeCore.made


def _engine(*args: str) -> Any:
    return CliRunner().invoke(main, ["engine", "--device", "cpu", *args])


# ---- lorastar engine --address --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "text"),
    [
        ("tcp://127.0.0.1", "give a port from 1 to 65535"),
        ("tcp://127.0.0.1:99999", "give a port from 1 to 65535"),
        ("tcp://0.0.0.0:5555", "bind it to 127.0.0.1 or an ipc:// path"),
        ("ipc:///nonexistent/dir/sock", "folder '/nonexistent/dir' does not exist"),
        ("udp://127.0.0.1:5555", "must start with tcp:// or ipc://"),
    ],
)
def test_engine_bad_address_is_one_line(address: str, text: str, fake_core: list[str]) -> None:
    _one_line_usage_error(_engine("--address", address), text)
    assert not fake_core


def test_engine_taken_tcp_port(fake_core: list[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _engine("--address", f"tcp://127.0.0.1:{port}")
    _one_line_usage_error(r, "cannot bind: Address already in use")
    assert not fake_core


def test_engine_ipc_path_a_live_core_holds(short_dir: Path, fake_core: list[str]) -> None:
    address = f"ipc://{short_dir}/core"
    ctx = zmq.Context()
    live = ctx.socket(zmq.PULL)
    live.bind(address)  # as a running `lorastar engine` does
    try:
        _one_line_usage_error(_engine("--address", address), "something already listens there")
        assert not fake_core and (short_dir / "core").is_socket()  # the live core keeps its socket
    finally:
        live.close(linger=0)
        ctx.term()


def test_engine_ipc_stale_socket_is_replaced_and_ready_is_logged(
    short_dir: Path, fake_core: list[str]
) -> None:
    path = short_dir / "core"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # bound, never listening, then closed: a dead core's leftover
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("lorastar")
    handler = Keep()
    log.addHandler(handler)
    try:
        r = _engine("--address", f"ipc://{path}")
    finally:
        log.removeHandler(handler)
    assert r.exit_code == 0, r.output
    assert fake_core == [f"ipc://{path}"]
    assert any(rec.getMessage() == f"lorastar: engine core ready at ipc://{path}" for rec in records)


def test_engine_ipc_path_another_starting_engine_holds(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ``lorastar engine`` on one ipc path at one instant both found no listener and both bound
    (zmq replaces the socket file). The first now holds ``PATH.lock`` from its checks to its exit:
    a second started meanwhile (here: while the first core loads) is a one-line error, and the path
    is free again once the first has ended."""
    import lorastar.engine.core_proc as core_proc

    address = f"ipc://{short_dir}/core"
    second: list[Any] = []

    class LoadingCore(FakeCore):
        def __init__(self, config: Any, address: str, report_to: str | None = None) -> None:
            second.append(_engine("--address", address))  # started while this one loads
            super().__init__(config, address, report_to)

    FakeCore.made = []
    monkeypatch.setattr(core_proc, "EngineCoreProc", LoadingCore)
    first = _engine("--address", address)
    assert first.exit_code == 0, first.output
    assert FakeCore.made == [address]  # the second made no core
    _one_line_usage_error(second[0], f"another `lorastar engine` holds '{short_dir}/core'")
    monkeypatch.setattr(core_proc, "EngineCoreProc", FakeCore)
    assert _engine("--address", address).exit_code == 0  # released at exit
    assert FakeCore.made == [address, address]


def test_engine_ipc_path_that_is_not_a_socket(short_dir: Path, fake_core: list[str]) -> None:
    (short_dir / "file").write_text("x")
    _one_line_usage_error(_engine("--address", f"ipc://{short_dir}/file"), "exists and is not a socket")
    assert (short_dir / "file").read_text() == "x"


def test_engine_taken_port_in_a_real_process_before_loading() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        p = subprocess.run(
            [sys.executable, "-m", "lorastar.plugin.cli", "engine", "--address", f"tcp://127.0.0.1:{port}"],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().count("\n") == 0 and "Address already in use" in p.stderr, p.stderr
    assert time.monotonic() - t0 < 30


def test_engine_block_size_needs_no_power_of_two() -> None:
    # The engine runs any block size (kernels index blocks with // and %): only < 1 is refused.
    _one_line_usage_error(_engine("--address", "tcp://127.0.0.1:5555", "--block-size", "0"), "block_size")


# ---- lorastar serve ------------------------------------------------------------------------------


@pytest.fixture
def adapters(tmp_path: Path) -> Path:
    for name, cfg in {
        "r16": {"r": 16},
        "pattern": {"r": 4, "rank_pattern": {"q_proj": 32}},
        "default": {},
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps(cfg))
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "adapter_config.json").write_text("{")
    return tmp_path


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--log-level", "bogus"], "'bogus' is not one of 'critical', 'error', 'warning', 'info'"),
        (["--shutdown-drain-timeout", "-1"], "-1.0 is not in the range x>=0"),
        (["--served-model-name", "up", "--adapter", "up=ROOT/default"], "adapter 'up' has the base model's"),
        (["--adapter", "SmolLM2-135M-Instruct=ROOT/default"], "has the base model's served name"),
        (["--max-lora-rank", "8", "--adapter", "a=ROOT/r16"], "rank 16 exceeds --max-lora-rank 8"),
        (["--max-lora-rank", "16", "--adapter", "a=ROOT/pattern"], "rank 32 exceeds --max-lora-rank 16"),
        (["--adapter", "a=ROOT/corrupt"], "adapter 'a': cannot read"),
    ],
)
def test_serve_startup_problems_are_one_line(
    args: list[str], text: str, adapters: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "run_server", lambda *a: pytest.fail("must not start"))
    r = CliRunner().invoke(main, ["serve", "--port", "0", *(a.replace("ROOT", str(adapters)) for a in args)])
    if "--log-level" in args or "--shutdown-drain-timeout" in args:  # click's own usage errors
        assert r.exit_code == 2 and text in r.output and "Traceback" not in r.output, r.output
    else:
        _one_line_usage_error(r, text)


def test_serve_accepts_what_fits(adapters: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_run(app: Any, sock: socket.socket, log_level: str) -> None:
        seen.update(app=app, log_level=log_level)
        sock.close()

    monkeypatch.setattr(cli, "run_server", fake_run)
    args = ["serve", "--port", "0", "--log-level", "WARNING", "--shutdown-drain-timeout", "0"]
    args += [
        "--max-lora-rank",
        "32",
        "--adapter",
        f"p={adapters / 'pattern'}",
        "--adapter",
        f"r={adapters / 'r16'}",
    ]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert seen["log_level"] == "warning"
    assert "loading the model" in r.output


def test_serve_with_engine_address_says_it_connects(adapters: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "run_server", lambda app, sock, level: sock.close())
    # A shared core has its own rank limit and base name: only they can refuse the adapter.
    args = ["serve", "--port", "0", "--engine-address", "ipc:///nowhere", "--max-lora-rank", "8"]
    r = CliRunner().invoke(main, [*args, "--adapter", f"a={adapters / 'r16'}"])
    assert r.exit_code == 0, r.output
    assert "connecting to the engine core at ipc:///nowhere" in r.output
    assert "loading the model" not in r.output


def test_log_levels_are_uvicorns() -> None:
    from uvicorn.config import LOG_LEVELS

    assert set(cli.LOG_LEVELS) == set(LOG_LEVELS)


def test_default_model_name_matches_the_engine() -> None:
    from lorastar.engine.engine import DEFAULT_MODEL_NAME

    assert cli.DEFAULT_MODEL_NAME == DEFAULT_MODEL_NAME


# ---- lorastar lora against a server without runtime loading --------------------------------------


@pytest.fixture(scope="module")
def fixed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    root = tmp_path_factory.mktemp("fixed")
    (root / "one").mkdir()
    (root / "one" / "adapter_config.json").write_text("{}")
    cfg = LoraStarConfig(
        async_engine=FakeAsyncLLM(),
        adapter_root=root,
        admin_token="tok",
        adapters={"one": str(root / "one")},
        allow_runtime_adapter_loading=False,
    )
    with ServerThread(create_app(cfg)) as srv:
        yield srv


@pytest.mark.parametrize("args", [["load", "two", "two"], ["unload", "one"]])
def test_lora_commands_say_runtime_loading_is_off(fixed_server: ServerThread, args: list[str]) -> None:
    r = CliRunner().invoke(main, ["lora", "--url", fixed_server.url, "--token", "tok", *args])
    assert r.exit_code == 1 and r.output.count("\n") == 1, r.output
    assert "runtime adapter loading is off" in r.output and "--no-runtime-loading" in r.output, r.output


def test_listing_works_without_runtime_loading(fixed_server: ServerThread) -> None:
    r = CliRunner().invoke(main, ["lora", "--url", fixed_server.url, "list"])
    assert r.exit_code == 0 and "one" in r.output, r.output
    r = CliRunner().invoke(main, ["lora", "--url", f"http://127.0.0.1:{free_port()}", "unload", "x"])
    assert r.exit_code == 1 and "cannot reach" in r.output, r.output
