"""The streaming protocol of ``/v1/completions`` and ``/v1/chat/completions`` (and the
``/v1/messages`` and ``/v1/responses`` streams) against vLLM's OpenAI server (fake engine: it answers with its prompt reversed, one character a token)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from plugin_fake_engine import FakeAsyncLLM
from plugin_support import ServerThread, wait_until

from lorastar.plugin import LoraStarConfig, create_app


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[ServerThread, FakeAsyncLLM]]:
    engine = FakeAsyncLLM()
    with ServerThread(create_app(LoraStarConfig(async_engine=engine))) as srv:
        yield srv, engine


ROUTES = [
    ("/v1/completions", {"prompt": ["abc", "def"], "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}], "n": 2}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "abc"}]}),
    ("/v1/responses", {"input": "abc"}),
]


@pytest.mark.parametrize(("route", "body"), ROUTES)
def test_a_stream_abandoned_before_its_first_token_is_aborted_at_once(
    fake: tuple[ServerThread, FakeAsyncLLM], route: str, body: dict[str, Any]
) -> None:
    """vLLM's stream listens for the client from the moment the request is submitted: a client
    that gives up while its request waits (queued, or in a long prefill) aborts it there. It must
    not wait in the engine, and then run, until its first token comes out."""
    srv, engine = fake
    engine.step_delay = 5.0  # the first output is 5 s away, as behind a queue
    try:
        old = set(engine.running)  # (the test's own requests are the others)
        payload = json.dumps({**body, "max_tokens": 5, "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(
            f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        expected = 2 if route == "/v1/completions" else 1  # one request per prompt
        assert wait_until(lambda: len(set(engine.running) - old) == expected, 5)  # no output yet...
        mine = set(engine.running) - old
        sock.close()  # ...when the client hangs up
        assert wait_until(lambda: not mine & set(engine.running) and mine <= set(engine.aborted), 2)
    finally:
        engine.step_delay = 0.002


@pytest.mark.parametrize(("route", "body"), ROUTES)
def test_a_stream_abandoned_mid_way_frees_every_request_at_once(
    fake: tuple[ServerThread, FakeAsyncLLM], route: str, body: dict[str, Any]
) -> None:
    """A client gone after the first chunks: every request of the call (each prompt of a batch,
    all n samples) leaves the engine then, not when it would have finished (10 s here)."""
    srv, engine = fake
    engine.step_delay = 0.05
    old = set(engine.running)
    try:
        with (
            httpx.Client(base_url=srv.url, timeout=30) as c,
            c.stream("POST", route, json={**body, "max_tokens": 200, "stream": True}) as s,
        ):
            lines = (line for line in s.iter_lines() if line.startswith("data: {"))
            for _ in range(3):
                next(lines)
            mine = set(engine.running) - old
            assert len(mine) == (2 if route == "/v1/completions" else 1)  # one request per prompt
        assert wait_until(lambda: not mine & set(engine.running), 2)
    finally:
        engine.step_delay = 0.002
