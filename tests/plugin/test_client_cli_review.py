"""Review of ``lorastar chat`` / ``lorastar complete``: answers and server replies a terminal client
meets (reasoning models, non-JSON replies, SSE framing, odd stdin), against a small fake
OpenAI-compatible server whose replies each test chooses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from plugin_support import stdlib_server

from lorastar.plugin.cli import main

REPO = Path(__file__).resolve().parents[2]


class _Fake:
    """``models``: the raw body of GET /v1/models (200); ``frames``: the raw SSE lines of a POST."""

    def __init__(self) -> None:
        self.models = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]})
        self.frames: list[str] = []
        self.requests: list[dict[str, Any]] = []


def _chunk(delta: dict[str, Any] | None = None, text: str | None = None, finish: str | None = None) -> str:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if delta is not None:
        choice["delta"] = delta
    if text is not None:
        choice["text"] = text
    return "data: " + json.dumps({"id": "x", "object": "chunk", "choices": [choice]})


@pytest.fixture()
def fake() -> Iterator[tuple[str, _Fake]]:
    state = _Fake()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: Any) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            body = state.models.encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802
            n = int(self.headers.get("content-length", 0))
            state.requests.append(json.loads(self.rfile.read(n)))
            body = "".join(f"{f}\n\n" for f in [*state.frames, "data: [DONE]"]).encode()
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with stdlib_server(Handler) as url:
        yield url, state


def _cli(
    args: list[str], stdin: bytes | None, *, close_stdin: bool = False
) -> subprocess.CompletedProcess[bytes]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for k in ("LORASTAR_API_KEY", "OPENAI_API_KEY"):
        env.pop(k, None)
    return subprocess.run(
        [sys.executable, "-m", "lorastar.plugin.cli", *args],
        **({"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}),
        preexec_fn=(lambda: os.close(0)) if close_stdin else None,
        capture_output=True,
        timeout=60,
    )


def test_a_reasoning_models_thinking_is_shown(fake: tuple[str, _Fake]) -> None:
    """A server with a reasoning parser streams the thinking as ``delta.reasoning_content`` (newer
    vLLM: ``delta.reasoning``); an answer cut by max_tokens while thinking has no ``content`` at all.
    The client printed an empty line: the user saw nothing for the whole generation."""
    url, state = fake
    state.frames = [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning_content": "Let me"}),
        _chunk({"reasoning": " think"}),
        _chunk({}, finish="length"),
    ]
    r = CliRunner().invoke(main, ["chat", "--url", url, "-q", "hi"])
    assert r.exit_code == 0, r.output
    assert "Let me" in r.output and "think" in r.output, repr(r.output)


def test_an_sse_data_field_without_the_space_is_read(fake: tuple[str, _Fake]) -> None:
    """SSE: ``data:{json}`` is the same field as ``data: {json}`` (the space is optional); the
    client skipped such frames and printed nothing, exit 0."""
    url, state = fake
    state.frames = ['data:{"choices":[{"index":0,"text":"hello","finish_reason":null}]}']
    r = CliRunner().invoke(main, ["complete", "--url", url, "-q", "hi"])
    assert r.exit_code == 0, r.output
    assert r.output == "hello\n", repr(r.output)


@pytest.mark.parametrize(
    "models, frames",
    [
        ("<html><body>Welcome</body></html>", []),  # --url at a web page, not an OpenAI server
        ('{"data": [{"name": "m"}]}', []),  # a listing without ids
        (None, ['data: {"error": "model crashed"}']),  # an in-band error as a plain string
        (None, ["data: <html>502 Bad Gateway</html>"]),  # a proxy's page inside the stream
    ],
)
def test_unexpected_replies_are_one_line_errors(
    fake: tuple[str, _Fake], models: str | None, frames: list[str]
) -> None:
    """A reply that is not what an OpenAI server sends ended in a Python traceback
    (JSONDecodeError, KeyError, AttributeError) instead of ``Error: ...`` (as a 404 or an
    unreachable server are)."""
    url, state = fake
    if models is not None:
        state.models = models
    state.frames = frames
    r = CliRunner().invoke(main, ["chat", "--url", url, "-q", "hi"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Error:" in r.output, r.output


def test_input_that_is_not_utf8_is_no_traceback(fake: tuple[str, _Fake]) -> None:
    """A Latin-1 line piped in (``printf 'caf\\xe9'``): Python reads it with surrogate escapes and
    httpx's JSON encoding raised UnicodeEncodeError with a traceback."""
    url, _ = fake
    p = _cli(["chat", "--url", url], b"caf\xe9\n")
    assert b"Traceback" not in p.stderr, p.stderr.decode(errors="replace")[-1500:]


def test_a_closed_stdin_is_no_traceback(fake: tuple[str, _Fake]) -> None:
    """``lorastar chat <&-`` (a service or cron job without stdin): sys.stdin is None and the client
    died with AttributeError on ``sys.stdin.isatty()``; it should end as at end of input."""
    url, _ = fake
    p = _cli(["chat", "--url", url], None, close_stdin=True)
    assert b"Traceback" not in p.stderr, p.stderr.decode(errors="replace")[-1500:]
