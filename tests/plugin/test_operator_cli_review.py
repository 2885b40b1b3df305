"""Operator-facing review of `lorastar lora ...` against odd servers and URLs (a one-line error, no
traceback) and of the shutdown drain (out of rotation at once, 503 + Retry-After for new requests)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
from click.testing import CliRunner
from plugin_fake_engine import FakeAsyncLLM
from plugin_support import stdlib_server

from lorastar.plugin import LoraStarConfig, LoraStarPlugin, create_app
from lorastar.plugin.cli import main
from lorastar.plugin.shutdown import drain


def _one_line_error(r: Any) -> None:
    assert r.exit_code == 1, (r.exit_code, r.output, r.exception)
    assert not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit), r.exception
    assert r.output.startswith("Error: ") and r.output.count("\n") == 1, r.output


@pytest.fixture(scope="module")
def other_server() -> Iterator[tuple[str, dict[str, bytes]]]:
    """A web server that is not lorastar: 200 with the body ``bodies["body"]`` on every GET."""
    bodies = {"body": b"<html><body>Grafana</body></html>"}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(bodies["body"])))
            self.end_headers()
            self.wfile.write(bodies["body"])

        def log_message(self, *args: Any) -> None:
            pass

    with stdlib_server(Handler) as url:
        yield url, bodies


@pytest.mark.parametrize("body", [b"<html><body>Grafana</body></html>", b"[1, 2]", b'{"data": [{"x": 1}]}'])
def test_list_against_a_server_that_is_not_lorastar(
    other_server: tuple[str, dict[str, bytes]], body: bytes
) -> None:
    url, bodies = other_server
    bodies["body"] = body
    r = CliRunner().invoke(main, ["lora", "--url", url, "list"])
    _one_line_error(r)
    assert "did not answer an OpenAI model list" in r.output, r.output


@pytest.mark.parametrize("url", ["http://127.0.0.1:80OO", "http://127.0.0.1:abc/v1", "http://x\x01y:8000"])
def test_invalid_url_is_one_line(url: str) -> None:
    r = CliRunner().invoke(main, ["lora", "--url", url, "list"])
    _one_line_error(r)
    assert "invalid --url" in r.output, r.output


def test_non_ascii_token_is_one_line() -> None:
    r = CliRunner().invoke(main, ["lora", "--url", "http://127.0.0.1:1", "--token", "tök", "unload", "a"])
    _one_line_error(r)
    assert "non-ASCII" in r.output, r.output


@pytest.mark.parametrize(
    "args", [["--timeout", "-1", "list"], ["--timeout", "nan", "list"], ["list", "--timeout", "inf"]]
)
def test_bad_timeout_is_a_usage_error(args: list[str]) -> None:
    r = CliRunner().invoke(main, ["lora", "--url", "http://127.0.0.1:1", *args])
    assert r.exit_code == 2 and "--timeout" in r.output and "Traceback" not in r.output, r.output
    assert not isinstance(r.exception, (ValueError, OverflowError)), r.exception


def test_drain_takes_the_server_out_of_rotation_and_answers_503_with_retry_after() -> None:
    """During the drain: /health 503 at once (a balancer stops routing here), new requests 503 with
    Retry-After, the in-flight request still completes within the window."""
    from litestar.testing import TestClient

    engine = FakeAsyncLLM(step_delay=0.01)
    app = create_app(LoraStarConfig(async_engine=engine, retry_after_seconds=3))
    service = app.plugins.get(LoraStarPlugin).service
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": 100}
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        answers: list[Any] = []
        t = threading.Thread(target=lambda: answers.append(c.post("/v1/completions", json=body)))
        t.start()
        for _ in range(200):  # the request is running
            if engine.has_unfinished():
                break
            threading.Event().wait(0.005)
        with c.portal() as portal:
            future = portal.start_task_soon(drain, service, 10.0)
        threading.Event().wait(0.05)
        h = c.get("/health")
        assert h.status_code == 503 and h.headers.get("retry-after") == "3", (h.status_code, h.headers)
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 503 and r.headers.get("retry-after") == "3", (r.status_code, r.headers)
        assert "shutting down" in r.json()["error"]["message"]
        assert future.result(timeout=10) == 0  # nothing had to be ended
        t.join(10)
        assert answers and answers[0].status_code == 200, answers


def test_request_ended_by_the_drain_timeout_is_503_with_retry_after() -> None:
    from litestar.testing import TestClient

    engine = FakeAsyncLLM(step_delay=0.02)
    app = create_app(LoraStarConfig(async_engine=engine, retry_after_seconds=2))
    service = app.plugins.get(LoraStarPlugin).service
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": 200}
    with TestClient(app) as c:
        answers: list[Any] = []
        t = threading.Thread(target=lambda: answers.append(c.post("/v1/completions", json=body)))
        t.start()
        for _ in range(200):
            if engine.has_unfinished():
                break
            threading.Event().wait(0.005)
        with c.portal() as portal:
            assert portal.call(drain, service, 0.1) == 1
        t.join(10)
    r = answers[0]
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
    assert r.headers.get("retry-after") == "2", r.headers


@pytest.mark.parametrize(("env", "value"), [("VLLM_API_KEY", "k1"), ("LORASTAR_API_KEY", "k1 k2")])
def test_list_reads_the_api_key_variables_serve_reads(
    env: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``serve`` takes VLLM_API_KEY (a deployment moved from vLLM) and several keys in one
    variable; ``lorastar lora`` read neither: its list got a 401."""
    seen: list[str | None] = []
    models = b'{"object": "list", "data": [{"id": "base", "object": "model"}]}'

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.send_header("Content-Length", str(len(models)))
            self.end_headers()
            self.wfile.write(models)

        def log_message(self, *args: Any) -> None:
            pass

    for name in ("VLLM_API_KEY", "LORASTAR_API_KEY", "LORASTAR_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(env, value)
    with stdlib_server(Handler) as url:
        r = CliRunner().invoke(main, ["lora", "--url", url, "list"])
    assert r.exit_code == 0, r.output
    assert seen and set(seen) == {"Bearer k1"}
