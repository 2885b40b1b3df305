"""Clients that hang up, on every generation route (streamed or not) and with every feature that
gives a request state of its own in the engine (n > 1, beam search, logprobs and prompt logprobs, a
JSON schema, a regex, forced and parsed tool calls, a reasoning parser, an adapter): the request
leaves the engine at once (as vLLM's ``with_cancellation`` and its streams do) and all it held
comes back: KV blocks, adapter references, the engine's per-request counters (check_invariants),
running and waiting gauges. Also a request hung up while it is queued, while its adapter is read
from disk by the resolver, and right as it finishes (no error logged, the next request served).
The engine runs as a thread of the server (the fake-engine protocol tests and the chaos test cover
the rest: tests/plugin/test_streaming_protocol_review.py, test_concurrent_chaos.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from plugin_support import ServerThread, engine_config, engine_idle, wait_until

TOOLS = [
    {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    }
]
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
CHAT = [{"role": "user", "content": "the cat sat on the mat"}]
LONG = {"max_tokens": 200, "ignore_eos": True}  # far from done when the client hangs up

CASES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": ["the cat", "a dog"], "n": 2, "logprobs": 2, **LONG}),
    ("/v1/completions", {"prompt": "the cat", "use_beam_search": True, "n": 2, "temperature": 0.0, **LONG}),
    ("/v1/completions", {"model": "alpha", "prompt": "the cat", "seed": 3, **LONG}),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2, "logprobs": True, "top_logprobs": 2, **LONG}),
    (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
            **LONG,
        },
    ),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": "required", **LONG}),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, **LONG}),  # hermes parser, qwen3 reasoning
    (
        "/v1/chat/completions",
        {"model": "beta", "messages": CHAT, "structured_outputs": {"regex": "[a-z ]+"}, **LONG},
    ),
    ("/v1/responses", {"input": "the cat", "max_output_tokens": 200, "ignore_eos": True, "top_logprobs": 2}),
    ("/v1/messages", {"model": "alpha", "messages": CHAT, **LONG}),
]
PROMPT_LOGPROBS = (
    "/v1/completions",
    {"prompt": "the cat", "echo": True, "logprobs": 1, "prompt_logprobs": 2, **LONG},
)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, adapter_root: Path) -> Iterator[Any]:
    """Two sequences at a time (more wait), alpha and beta loaded, gamma loadable by the resolver,
    a reasoning parser and a tool-call parser on."""
    from lorastar.plugin import LoraStarConfig, LoraStarPlugin, create_app

    config = LoraStarConfig(
        engine=engine_config(tiny_model_dir, max_num_seqs=2),
        served_model_name="tiny",
        adapters={"alpha": str(adapter_root / "alpha"), "beta": str(adapter_root / "beta")},
        adapter_root=adapter_root,
        enable_adapter_resolver=True,
        admin_token="admin",
        reasoning_parser="qwen3",
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    app = create_app(config)
    with ServerThread(app) as srv:
        srv.plugin = app.plugins.get(LoraStarPlugin)  # type: ignore[attr-defined]
        engine = srv.plugin.engine.engine
        step = engine.step

        def slow_step() -> Any:  # the tiny model's 200 tokens take ms: a model of a real size's pace
            time.sleep(0.003)
            return step()

        engine.step = slow_step
        yield srv


def busy(engine: Any) -> int:
    s = engine.stats()
    return 0 if s is None else s.num_running + s.num_waiting


def assert_all_freed(srv: Any) -> None:
    """Nothing running or waiting, no KV block or adapter reference held, the engine's counters of
    live requests (sync, host-reading, prompt-logprob, adapter requests) back to zero."""
    engine = srv.plugin.engine
    assert wait_until(lambda: engine_idle(engine), 5), (engine.stats(), engine.list_adapters())
    assert not engine.engine.requests
    engine.engine.check_invariants()


def send_raw(port: int, route: str, body: dict[str, Any]) -> socket.socket:
    """A request on a socket of its own, so that closing it is a disconnect the server sees."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def in_engine(srv: Any, sock: socket.socket, count: int = 1) -> None:
    """Wait until ``count`` requests are in the engine; else fail with the server's answer."""
    if not wait_until(lambda: busy(srv.plugin.engine) >= count, 5):
        sock.settimeout(1)
        raise AssertionError(sock.recv(4000).decode(errors="replace"))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("route", "body"), CASES)
def test_a_client_gone_mid_generation_frees_everything(
    server: Any, route: str, body: dict[str, Any], stream: bool
) -> None:
    sock = send_raw(server.port, route, {**body, "stream": stream})
    try:
        in_engine(server, sock)
        if stream:
            sock.recv(1)  # the stream has started
    finally:
        sock.close()
    assert_all_freed(server)


def test_a_client_gone_while_prompt_logprobs_are_computed_frees_everything(server: Any) -> None:
    route, body = PROMPT_LOGPROBS  # (not with stream=true: a 400)
    sock = send_raw(server.port, route, body)
    try:
        in_engine(server, sock)
    finally:
        sock.close()
    assert_all_freed(server)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_clients_gone_while_queued_leave_the_queue_and_the_running_ones_run_on(
    server: Any, stream: bool
) -> None:
    engine = server.plugin.engine
    held = [
        send_raw(server.port, "/v1/completions", {"prompt": "the cat", **LONG, "max_tokens": 240})
        for _ in range(2)
    ]
    try:
        assert wait_until(lambda: engine.stats().num_running == 2, 5)  # both slots taken
        for route, body in (CASES[0], CASES[4], CASES[8]):
            sock = send_raw(server.port, route, {**body, "stream": stream})
            assert wait_until(lambda: engine.stats().num_waiting >= 1, 5), engine.stats()
            sock.close()
            assert wait_until(lambda: engine.stats().num_waiting == 0, 5), (route, engine.stats())
            assert engine.stats().num_running == 2
    finally:
        for sock in held:
            sock.close()
    assert_all_freed(server)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_client_gone_while_the_resolver_reads_its_adapter_from_disk(server: Any, stream: bool) -> None:
    """The load completes (the adapter stays loaded for the next requests), but the request it was
    for is aborted at once, not run to its 240 tokens for nobody."""
    engine = server.plugin.engine
    gate, entered = threading.Event(), threading.Event()
    load = engine.load_adapter

    async def slow_load(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        while not gate.is_set():
            await asyncio.sleep(0.01)
        return await load(*args, **kwargs)

    engine.load_adapter = slow_load
    try:
        before = engine.stats().generation_tokens_total
        body = {"model": "gamma", "prompt": "the cat", **LONG, "max_tokens": 240, "stream": stream}
        sock = send_raw(server.port, "/v1/completions", body)
        assert entered.wait(5)
        sock.close()  # the client gives up while the adapter loads
        gate.set()
        assert wait_until(lambda: "gamma" in [a.name for a in engine.list_adapters()], 5)
        assert_all_freed(server)
        assert engine.stats().generation_tokens_total - before < 240
    finally:
        del engine.load_adapter
        with httpx.Client(base_url=server.url, timeout=30) as c:
            c.post(
                "/v1/unload_lora_adapter",
                json={"lora_name": "gamma"},
                headers={"Authorization": "Bearer admin"},
            )


def test_clients_gone_as_their_requests_finish_log_no_error(
    server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Short requests whose clients hang up around the moment they end: no double free, nothing
    logged at warning or above, and the next request is served."""
    caplog.set_level(logging.WARNING)
    socks = []
    for i in range(30):
        route, body = CASES[i % len(CASES)]
        short = {**body, "max_tokens": 1 + i % 3, "max_output_tokens": 16, "ignore_eos": False}
        socks.append(send_raw(server.port, route, {**short, "stream": bool(i % 2)}))
        if i % 3:
            socks.pop(0).close()
    for sock in socks:
        sock.close()
    assert_all_freed(server)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 2}).status_code == 200
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
