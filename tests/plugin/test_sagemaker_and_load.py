"""vLLM's serving extras for platforms and balancers: SageMaker's ``/ping`` and ``/invocations``
(``LoraStarConfig.sagemaker_routes``, on under ``lorastar serve``) and ``GET /load`` with
``--enable-server-load-tracking`` (the generation requests being answered, a stream until its end)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar, get
from litestar.response import Stream
from litestar.testing import TestClient
from plugin_fake_engine import FakeAsyncLLM
from plugin_support import serve_config

from lorastar.plugin import LoraStarConfig, create_app, lifespan
from lorastar.plugin.asgi_call import ResponseStart, call_asgi, http_scope

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}
COMPLETION = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
VOLATILE = ("id", "created")


def _app(engine: Any = None, **kw: Any) -> Any:
    return create_app(LoraStarConfig(async_engine=engine or FakeAsyncLLM(), **kw))


def _stable(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in VOLATILE}


def test_ping_answers_as_health_does() -> None:
    engine = FakeAsyncLLM()
    with TestClient(_app(engine, sagemaker_routes=True)) as c:
        assert c.get("/ping").status_code == 200 and c.post("/ping").status_code == 200
        assert c.get("/ping").text == c.get("/health").text == ""
        engine.errored = True
        for r in (c.get("/ping"), c.post("/ping"), c.get("/health")):
            assert r.status_code == 503 and r.json()["error"]["message"] == "The engine has stopped."
    with TestClient(_app()) as c:  # off unless asked for (an app's own /ping stays its own)
        assert c.get("/ping").status_code == 404 and c.post("/invocations", json=CHAT).status_code == 404
        assert c.get("/load").status_code == 404


def test_invocations_answers_as_the_route_its_body_is_for() -> None:
    with TestClient(_app(sagemaker_routes=True)) as c:
        for body, route in ((CHAT, "/v1/chat/completions"), (COMPLETION, "/v1/completions")):
            direct, via = c.post(route, json=body), c.post("/invocations", json=body)
            assert via.status_code == direct.status_code == 200, via.text
            assert _stable(via.json()) == _stable(direct.json())
            with c.stream("POST", "/invocations", json={**body, "stream": True}) as s:
                assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
                events = [x for x in "".join(s.iter_text()).split("\n\n") if x]
            assert events[-1] == "data: [DONE]" and len(events) > 2
        # the route's own validation answers a bad body of its kind
        r = c.post("/invocations", json={**CHAT, "max_tokens": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        for bad, words in (
            (b'{"text": "hi"}', "with 'messages'"),  # ('input' is an embeddings request)
            (b"[1, 2]", "with 'prompt'"),
            (b"{nope", "not valid JSON"),
        ):
            r = c.post("/invocations", content=bad, headers={"content-type": "application/json"})
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        r = c.get("/invocations")
        assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_invocations_keeps_the_routes_api_key() -> None:
    with TestClient(_app(sagemaker_routes=True, api_keys=["sk-1"])) as c:
        r = c.post("/invocations", json=CHAT)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        r = c.post("/invocations", json=CHAT, headers={"Authorization": "Bearer sk-1"})
        assert r.status_code == 200, r.text
        assert c.get("/ping").status_code == 200  # a probe sends no key


def test_load_counts_generation_requests_until_their_end() -> None:
    """A stream counts from its arrival until its last event; a refused request and the other
    routes do not stay counted."""
    app = _app(FakeAsyncLLM(step_delay=0.02), enable_server_load_tracking=True, sagemaker_routes=True)

    async def get_load() -> int:
        chunks = [c async for c in call_asgi(app, http_scope("GET", "/load", b"", []), b"")]
        assert isinstance(chunks[0], ResponseStart) and chunks[0].status == 200
        return json.loads(b"".join(c for c in chunks[1:] if isinstance(c, bytes)))["server_load"]

    def post(path: str, body: dict[str, Any]) -> Any:
        scope = http_scope("POST", path, b"", [(b"content-type", b"application/json")])
        return call_asgi(app, scope, json.dumps(body).encode())

    async def main() -> list[int]:
        seen = []
        async with lifespan(app):
            seen.append(await get_load())
            streams = [
                post("/v1/chat/completions", {**CHAT, "max_tokens": 40, "stream": True}),
                post("/invocations", {**COMPLETION, "max_tokens": 40, "stream": True}),
            ]
            for s in streams:
                start = await anext(s)
                assert isinstance(start, ResponseStart) and start.status == 200
                await anext(s)  # its first event: the request is being answered
            seen.append(await get_load())
            async for _ in streams[0]:
                pass
            seen.append(await get_load())
            async for _ in streams[1]:
                pass
            seen.append(await get_load())
            refused = [c async for c in post("/v1/completions", {**COMPLETION, "max_tokens": 0})]
            assert refused[0].status == 400  # type: ignore[union-attr]
            [_ async for _ in post("/tokenize", {"prompt": "hi"})]
            seen.append(await get_load())
        return seen

    assert asyncio.run(main()) == [0, 2, 1, 0, 0]


def test_serve_mounts_the_sagemaker_routes_and_takes_the_load_flag(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text("{}")
    r, config = serve_config(monkeypatch, [str(tmp_path), "--port", "0"])
    assert r.exit_code == 0, r.output
    assert config.sagemaker_routes and not config.enable_server_load_tracking
    r, config = serve_config(monkeypatch, [str(tmp_path), "--port", "0", "--enable-server-load-tracking"])
    assert r.exit_code == 0, r.output
    assert config.enable_server_load_tracking


def test_call_asgi_ends_after_a_streamed_answer() -> None:
    """A Litestar stream waits for ``http.disconnect`` after its last chunk, as a server sends it
    once a response is complete. ``call_asgi`` (Ray replicas, run-batch, these tests) now sends
    it: a consumer reading a streamed answer to its end (curl through Ray Serve) waited forever."""

    async def numbers() -> Any:
        for i in range(3):
            yield f"{i}\n"

    @get("/s")
    async def s() -> Stream:
        return Stream(numbers())

    async def main() -> list[Any]:
        it = call_asgi(Litestar([s]), http_scope("GET", "/s", b"", []), b"")
        return await asyncio.wait_for(_drain(it), 10)

    async def _drain(it: Any) -> list[Any]:
        return [x async for x in it]

    got = asyncio.run(main())
    assert isinstance(got[0], ResponseStart) and got[0].status == 200
    assert b"".join(got[1:]) == b"0\n1\n2\n"
