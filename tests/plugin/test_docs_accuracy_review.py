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
