"""Behaviour the docs state, checked where the code did otherwise (docs-accuracy review)."""

from __future__ import annotations

from litestar import Litestar, get
from plugin_fake_engine import FakeAsyncLLM

from lorastar.plugin import LoraStarConfig, LoraStarPlugin


@get("/mine")
async def mine() -> str:
    return "mine"


def test_include_in_schema_false_hides_every_plugin_route() -> None:
    """``LoraStarConfig.include_in_schema`` says "List the plugin's routes in the app's OpenAPI
    schema": with ``False`` the root routes (``/tokenize``, ``/detokenize``, ``/version``,
    ``/lorastar/stats``) were still listed, only ``/v1/...``, ``/health`` and ``/metrics`` left out."""
    hidden = Litestar(
        [mine], plugins=[LoraStarPlugin(LoraStarConfig(async_engine=FakeAsyncLLM(), include_in_schema=False))]
    )
    assert sorted(hidden.openapi_schema.paths or {}) == ["/mine"]
    shown = Litestar([mine], plugins=[LoraStarPlugin(LoraStarConfig(async_engine=FakeAsyncLLM()))])
    paths = set(shown.openapi_schema.paths or {})
    assert {"/mine", "/v1/chat/completions", "/health", "/metrics", "/tokenize", "/version"} <= paths
    assert "/lorastar" not in paths  # the static page is never listed


def test_health_during_a_restart_says_retry_after_as_the_other_503s() -> None:
    """A request refused while the engine restarts gets ``Retry-After`` = the larger of the engine's
    backoff and ``retry_after_seconds``; ``/health`` sent the engine's backoff alone (1 s here)."""
    from litestar.testing import TestClient

    engine = FakeAsyncLLM()
    app = Litestar(plugins=[LoraStarPlugin(LoraStarConfig(async_engine=engine, retry_after_seconds=7))])
    with TestClient(app) as c:
        engine.restarting, engine.retry_after = True, 0.2
        health = c.get("/health")
        request = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert (health.status_code, request.status_code) == (503, 503)
        assert health.headers["retry-after"] == request.headers["retry-after"] == "7"
        engine.restarting, engine.retry_after = True, 12.5  # the backoff when longer
        assert c.get("/health").headers["retry-after"] == "13"
