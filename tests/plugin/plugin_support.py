"""Helpers of the plugin tests (a module of its own, so test files import it by a distinctive name)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1:<free port> in a thread (lifespan included)."""

    def __init__(self, app: Any, *, startup_timeout: float = 120.0) -> None:
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                lifespan="on",
                timeout_graceful_shutdown=10,
            )
        )
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"uvicorn-{self.port}")
        self.startup_timeout = startup_timeout

    def _run(self) -> None:
        try:
            self.server.run()
        except SystemExit:  # uvicorn exits when the app's startup fails; the test sees it in __enter__
            pass

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.server.should_exit = True
                raise RuntimeError("uvicorn did not start (see the log above)")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def wait_until(predicate: Any, timeout: float = 20.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def engine_idle(engine: Any) -> bool:
    """No running or waiting request, no KV block in use, no adapter reference held (False while a
    restarting engine has no counters)."""
    s = engine.stats()
    return (
        s is not None
        and s.num_running == 0
        and s.num_waiting == 0
        and s.kv_cache_usage == 0
        and all(a.in_flight == 0 for a in engine.list_adapters())
    )


def make_adapter(model_dir: Path, out: Path, seed: int, rank: int = 4) -> Path:
    """A real PEFT LoRA folder for ``model_dir`` on all seven projections (``make_peft_adapter``)."""
    from tests.conftest import ALL_TARGETS, make_peft_adapter

    return Path(make_peft_adapter(model_dir, out, seed, r=rank, targets=ALL_TARGETS, scale=0.5))


def engine_config(model_dir: Path, **kw: Any) -> Any:
    from lorastar.config import EngineConfig

    opts: dict[str, Any] = dict(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=512,
        max_num_seqs=32,
        max_loras=4,
        max_cpu_loras=8,
    )
    opts.update(kw)
    return EngineConfig(**opts)


def serve_config(monkeypatch: Any, args: list[str], env: dict[str, str] | None = None) -> tuple[Any, Any]:
    """``lorastar serve ARGS`` up to uvicorn, which is not started: (click's result, the app's
    ``LoraStarConfig``, or None when the command stopped before building the app)."""
    from click.testing import CliRunner

    from lorastar.plugin import cli

    seen: dict[str, Any] = {}

    def fake_run(app: Any, sock: Any, log_level: str, **uvicorn_kw: Any) -> None:
        seen["config"] = app.plugins.get("LoraStarPlugin").config
        sock.close()

    monkeypatch.setattr(cli, "run_server", fake_run)
    result = CliRunner().invoke(cli.main, ["serve", *args], env=env)
    return result, seen.get("config")


@contextlib.contextmanager
def stdlib_server(handler: type) -> Iterator[str]:
    """A stdlib ``ThreadingHTTPServer`` answering with ``handler`` on 127.0.0.1, in a thread: its URL."""
    from http.server import ThreadingHTTPServer

    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
