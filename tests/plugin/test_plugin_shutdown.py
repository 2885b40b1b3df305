"""Ctrl-C on ``lorastar serve`` (a real process, a real SIGINT) during a long stream: the stream gets
``shutdown_drain_timeout`` seconds, then a final error frame and ``data: [DONE]``; exit code 0, no
traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from plugin_support import free_port, wait_until

REPO = Path(__file__).resolve().parents[2]


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(
    ("signals", "engine_process"),
    [(1, False), (2, False), (1, True)],
    ids=["one-sigint", "two-sigints", "one-sigint-to-the-group-engine-process"],
)
def test_sigint_drains_then_ends_streams_and_exits_0(signals: int, engine_process: bool) -> None:
    """One SIGINT: the 1.5 s drain window, then the error frame. Two: the stream ends at once (the
    drain window is 60 s here), still with the error frame, exit 0 and no traceback. With the engine
    in a process of its own, the SIGINT goes to the whole process group, as Ctrl-C in a terminal
    sends it: the core child must not die before the drain, and must be gone after."""
    drain = "1.5" if signals == 1 else "60"
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lorastar.plugin.cli", "serve", "--port", str(port), "--device", "cpu",
         "--dtype", "float32", "--max-model-len", "1024", "--num-gpu-blocks-override", "128",
         "--shutdown-drain-timeout", drain, "--engine-process" if engine_process else "--no-engine-process"],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=engine_process,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None

    frames: list[str] = []
    first = threading.Event()

    def stream() -> None:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 600,
                "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    frames.append(line[6:])
                    first.set()

    try:
        assert wait_until(healthy, timeout=180, interval=0.2) and proc.poll() is None, proc.stderr
        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60)
        time.sleep(0.5)
        core = _children(proc.pid) if engine_process else []
        assert len(core) == (1 if engine_process else 0), core
        t0 = time.monotonic()
        if engine_process:
            os.killpg(proc.pid, signal.SIGINT)  # the server and its core, as a terminal's Ctrl-C
        else:
            proc.send_signal(signal.SIGINT)
        if signals == 2:
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
        t.join(30)
        ended = time.monotonic() - t0
        assert not t.is_alive()
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = err.decode(errors="replace")
    assert frames[-1] == "[DONE]", frames[-3:]
    last = json.loads(frames[-2])
    assert "error" in last and "shutting down" in last["error"]["message"], last
    if signals == 1:
        assert 1.0 < ended < 15, ended  # waited for the drain window, not for the 600 tokens
    else:
        assert ended < 10, ended  # not the 60 s window
    generated = sum(len(json.loads(f)["choices"][0]["text"]) for f in frames[:-2] if "choices" in f)
    assert generated > 0
    assert proc.returncode == 0, stderr[-3000:]
    # the start-up summary went to stderr before the server answered
    assert "KV cache: 128 blocks of 16 tokens = 2048 tokens" in stderr, stderr[-3000:]
    assert f"OpenAI API at http://127.0.0.1:{port}/v1" in stderr
    assert "Traceback" not in stderr and "terminate called" not in stderr, stderr[-3000:]
    assert wait_until(lambda: not any(map(_alive, core)), timeout=10, interval=0.2)
