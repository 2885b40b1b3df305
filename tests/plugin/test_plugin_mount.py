"""create_app() mounted under a prefix in another ASGI framework (Starlette), driven by the openai client."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from plugin_fake_engine import FakeAsyncLLM
from plugin_support import ServerThread, engine_config

from lorastar.plugin import LoraStarConfig, create_app, lifespan


@pytest.fixture(scope="session")
def starlette() -> Any:
    return pytest.importorskip("starlette", reason="starlette is not installed (add it to the test extra)")


def test_starlette_mount_with_lifespan(starlette: Any, tiny_model_dir: Path, adapter_root: Path) -> None:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Mount, Route

    llm = create_app(
        LoraStarConfig(
            engine=engine_config(tiny_model_dir),
            served_model_name="tiny",
            adapters={"alpha": str(adapter_root / "alpha")},
        )
    )

    async def home(_: Request) -> JSONResponse:
        return JSONResponse({"starlette": True})

    # Starlette's Mount does not forward lifespan events: the parent runs the mounted app's lifespan.
    app = Starlette(routes=[Route("/", home), Mount("/llm", app=llm)], lifespan=lambda _: lifespan(llm))
    with ServerThread(app) as srv:
        plugin_service = llm.plugins.get("LoraStarPlugin").service
        assert plugin_service.started  # started by the lifespan, not lazily by a request
        assert httpx.get(srv.url + "/").json() == {"starlette": True}
        assert httpx.get(srv.url + "/llm/health").status_code == 200
        client = openai.OpenAI(base_url=srv.url + "/llm/v1", api_key="x")
        assert [m.id for m in client.models.list().data] == ["tiny", "alpha"]
        r = client.completions.create(model="alpha", prompt="Hello", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == r.usage.completion_tokens and r.choices[0].finish_reason
        chunks = list(
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].usage.completion_tokens >= 1
        err = httpx.post(srv.url + "/llm/v1/completions", json={"model": "nope", "prompt": "x"})
        assert err.status_code == 404 and err.json()["error"]["type"] == "NotFoundError"
    assert not plugin_service.started  # the parent's shutdown stopped the engine


def test_plain_asgi_prefix_mount_starts_engine_lazily() -> None:
    """Without any lifespan forwarding the engine still starts, on the first request."""
    engine = FakeAsyncLLM()
    llm = create_app(LoraStarConfig(async_engine=engine))

    async def parent(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # a framework that swallows lifespan for its mounts
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        if scope["path"].startswith("/prefix/"):
            scope = dict(scope, root_path=scope.get("root_path", "") + "/prefix")
            await llm(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    with ServerThread(parent) as srv:
        assert not engine.started
        client = openai.OpenAI(base_url=srv.url + "/prefix/v1", api_key="x")
        r = client.completions.create(model="fake-model", prompt="abc", max_tokens=3)
        assert r.choices[0].text == "cba" and engine.started


def test_the_apps_own_health_and_metrics_routes_win(caplog: pytest.LogCaptureFixture) -> None:
    """on_app_init adds only what the app has not set: an app that already serves GET /health
    (a handler), /metrics (a controller, as litestar's PrometheusController) and /tokenize (in a
    router) keeps them; the plugin's are left out with a warning (the app used to refuse to start:
    'Handler already registered for path')."""
    import logging

    from litestar import Controller, Litestar, Router, get, post
    from litestar.testing import TestClient

    from lorastar.plugin import LoraStarPlugin

    @get("/health/", sync_to_thread=False)
    def health() -> str:
        return "mine"

    class Metrics(Controller):
        path = "/metrics"

        @get(sync_to_thread=False)
        def scrape(self) -> str:
            return "my metrics"

    @post("/tokenize", sync_to_thread=False)
    def tokenize() -> str:
        return "my tokenizer"

    caplog.set_level(logging.WARNING, "lorastar.plugin")
    plugin = LoraStarPlugin(LoraStarConfig(async_engine=FakeAsyncLLM(), served_model_name="tiny"))
    app = Litestar([health, Metrics, Router("/", route_handlers=[tokenize])], plugins=[plugin])
    with TestClient(app) as c:
        assert c.get("/health").text == "mine"
        assert c.get("/metrics").text == "my metrics"
        assert c.post("/tokenize", json={"prompt": "hi"}).text == "my tokenizer"
        assert c.post("/detokenize", json={"tokens": [1]}).status_code == 200  # not taken: the plugin's
        assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"
    warned = [r.getMessage() for r in caplog.records]
    for path in ("/health", "/metrics", "/tokenize"):
        assert any(f"serves {path} itself" in m for m in warned), warned
