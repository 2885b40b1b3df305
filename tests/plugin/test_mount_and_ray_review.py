"""Review of mounting (Starlette/FastAPI, a root_path) and of the Ray Serve ingress: paths under a prefix."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from litestar import Litestar, get
from litestar.testing import TestClient as LitestarTestClient
from plugin_fake_engine import FakeAsyncLLM

from lorastar.plugin import LoraStarConfig, LoraStarPlugin, lifespan
from lorastar.plugin.errors import app_path


@get("/mine", sync_to_thread=False)
def mine() -> str:
    return "mine"


def _plugin_app() -> Litestar:
    return Litestar([mine], plugins=[LoraStarPlugin(LoraStarConfig(async_engine=FakeAsyncLLM()))])


def _is_openai_error(body: dict[str, Any], code: int) -> bool:
    return body.get("error", {}).get("code") == code


@pytest.mark.parametrize(
    ("path", "root_path", "want"),
    [
        ("/llm/v1/x", "/llm", "/v1/x"),  # ASGI 3 / uvicorn / Starlette Mount: the prefix in both
        ("/llm", "/llm", "/"),
        ("/v1/x", "/llm", "/v1/x"),  # an older server: path without the root_path
        ("/llmx/v1", "/llm", "/llmx/v1"),  # not under the prefix: only whole segments are stripped
        ("/v1/x", "", "/v1/x"),
        ("/v1/x", "/", "/v1/x"),
    ],
)
def test_app_path(path: str, root_path: str, want: str) -> None:
    assert app_path({"path": path, "root_path": root_path}) == want


def test_plugin_errors_stay_openai_shaped_in_a_starlette_mount() -> None:
    """A Litestar app with the plugin mounted under /llm: unknown /v1 routes and wrong methods are
    OpenAI errors, as unmounted (they were Litestar's ``{"status_code", "detail"}``: the plugin's
    scoped 404/405 handler matched ``request.url.path``, which repeats the root_path)."""
    from starlette.applications import Starlette
    from starlette.routing import Mount
    from starlette.testclient import TestClient

    lit = _plugin_app()
    app = Starlette(routes=[Mount("/llm", app=lit)], lifespan=lambda _: lifespan(lit))
    with TestClient(app) as c:
        assert c.get("/llm/v1/models").json()["data"][0]["id"] == "fake-model"
        assert _is_openai_error(c.get("/llm/v1/nope").json(), 404)
        assert _is_openai_error(c.put("/llm/v1/models").json(), 405)
        assert c.get("/llm/mine/nope").json() == {"status_code": 404, "detail": "Not Found"}  # the app's


def test_plugin_errors_stay_openai_shaped_behind_a_root_path() -> None:
    """``uvicorn --root-path /api`` (a proxy strips /api): same scoped 404/405 as without it."""
    with LitestarTestClient(_plugin_app(), root_path="/api") as c:
        assert _is_openai_error(c.get("/v1/nope").json(), 404)
        assert _is_openai_error(c.post("/health").json(), 405)
        assert c.get("/mine/nope").json() == {"status_code": 404, "detail": "Not Found"}


class _Replicas:
    """A replica handle that records the call and answers ``{}``."""

    def __init__(self) -> None:
        self.args: tuple[Any, ...] = ()
        self.options_seen: dict[str, Any] = {}

    def options(self, **kw: Any) -> _Replicas:
        self.options_seen = kw
        return self

    @property
    def handle_http(self) -> _Replicas:
        return self

    def remote(self, *args: Any) -> Any:
        from lorastar.plugin.asgi_call import ResponseStart

        self.args = args

        async def gen() -> Any:
            yield ResponseStart(200, [(b"content-type", b"application/json")])
            yield b"{}"

        return gen()


def _ingress_call(body: bytes, path: str = "/v1/completions", root_path: str = "") -> _Replicas:
    """``body`` POSTed to a multiplexed ingress (base ``base``); the replica handle it called."""
    pytest.importorskip("ray.serve")
    from starlette.requests import Request

    from lorastar.ray.ingress import LoraStarIngress

    replicas = _Replicas()
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "root_path": root_path,
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def main() -> None:
        response = await LoraStarIngress(replicas, ["base"])(Request(scope, receive))
        assert response.status_code == 200

    asyncio.run(main())
    return replicas


def test_ray_ingress_forwards_the_path_relative_to_route_prefix() -> None:
    """``serve.run(app, route_prefix="/llm")``: Serve's proxy sets root_path="/llm" and keeps the
    whole path; the replica's app serves /v1/..., so the ingress must forward the path below the
    prefix (it forwarded /llm/v1/completions: every route was a 404)."""
    replicas = _ingress_call(b'{"model": "a1"}', "/llm/v1/completions", "/llm")
    assert replicas.args[1:3] == ("POST", "/v1/completions")


@pytest.mark.parametrize(
    ("body", "adapter"),
    [
        (b'{"model": "base", "adapter_id": "a1", "prompt": "x"}', "a1"),
        (b'{"adapter_id": "a1", "prompt": "x"}', "a1"),
        (b'{"model": "a2", "adapter_id": "a1"}', "a2"),  # the replica's routes answer the mismatch (400)
        (b'{"model": "base", "adapter_id": "base"}', None),
        (b'{"model": "base", "adapter_id": 3}', None),
    ],
)
def test_ray_ingress_routes_by_loraxs_adapter_id(body: bytes, adapter: str | None) -> None:
    """The plugin's routes take LoRAX's ``adapter_id`` as the adapter; replicas load adapters only
    through Ray's multiplexing (their resolver is off), so the ingress must route and pin by it too
    (it did not: ``{"model": "base", "adapter_id": "a1"}`` was a 404 on every replica)."""
    replicas = _ingress_call(body)
    assert replicas.args[0] == adapter
    assert replicas.options_seen.get("multiplexed_model_id") == adapter
