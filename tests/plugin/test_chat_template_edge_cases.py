"""Edge cases of ``/v1/chat/completions`` against vLLM's behaviour for the same request (fake
engine: it answers with its prompt reversed, one character a token)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from plugin_fake_engine import FakeAsyncLLM
from plugin_support import ServerThread

from lorastar.plugin import LoraStarConfig, create_app

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def fake() -> FakeAsyncLLM:
    return FakeAsyncLLM()


@pytest.fixture(scope="module")
def http(fake: FakeAsyncLLM) -> Iterator[httpx.Client]:
    """A server without auto tool choice (no ``--enable-auto-tool-choice``)."""
    with (
        ServerThread(create_app(LoraStarConfig(async_engine=fake))) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as c,
    ):
        yield c


def _chat(**extra: object) -> dict[str, object]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra}


def test_an_empty_tools_list_defaults_tool_choice_to_none(http: httpx.Client, fake: FakeAsyncLLM) -> None:
    """vLLM defaults ``tool_choice`` to "auto" only when ``tools`` is non-empty: ``tools: []`` (which
    some clients send with every request) is "none", served without auto tool choice."""
    r = http.post("/v1/chat/completions", json=_chat(tools=[]))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["tool_calls"] == []
    assert fake.rendered[-1][1] == []  # what the template was handed: no tool to render
    # non-empty tools still default to "auto", which this server refuses (vLLM's message)
    r = http.post("/v1/chat/completions", json=_chat(tools=TOOLS))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
    # "required" still needs a tool to call
    r = http.post("/v1/chat/completions", json=_chat(tools=[], tool_choice="required"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_continuous_usage_counts_each_choices_own_tokens(http: httpx.Client) -> None:
    """vLLM's ``continuous_usage_stats`` with n > 1: a choice's chunk counts that choice's tokens
    so far (``previous_num_tokens[i]``), not all choices'; the final usage chunk sums them."""
    body = _chat(n=2, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    frames = [json.loads(f[6:]) for f in http.post("/v1/chat/completions", json=body).text.split("\n\n")[:-2]]
    seen: dict[int, int] = {}
    for f in frames[:-1]:
        (ch,) = f["choices"]
        seen[ch["index"]] = seen.get(ch["index"], 0) + len(ch["delta"].get("content", ""))  # a token a char
        assert f["usage"]["completion_tokens"] == seen[ch["index"]], f
        assert f["usage"]["total_tokens"] == f["usage"]["prompt_tokens"] + seen[ch["index"]]
    assert seen == {0: 3, 1: 3}
    assert frames[-1]["choices"] == [] and frames[-1]["usage"]["completion_tokens"] == 6


def test_completions_continuous_usage_counts_each_choices_own_tokens(http: httpx.Client) -> None:
    """The same rule on ``/v1/completions``, with two prompts and n = 2 (four choices): each chunk
    counts its own choice's tokens and its own prompt; the final usage chunk sums them all."""
    body = {"model": "fake-model", "prompt": ["abc", "defgh"], "max_tokens": 3, "n": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    frames = [json.loads(f[6:]) for f in http.post("/v1/completions", json=body).text.split("\n\n")[:-2]]
    seen: dict[int, int] = {}
    for f in frames[:-1]:
        (ch,) = f["choices"]
        seen[ch["index"]] = seen.get(ch["index"], 0) + len(ch["text"])  # the fake engine: a token a char
        assert f["usage"]["completion_tokens"] == seen[ch["index"]], f
        assert f["usage"]["prompt_tokens"] == (3 if ch["index"] < 2 else 5), f
    assert seen == {0: 3, 1: 3, 2: 3, 3: 3}
    assert frames[-1]["choices"] == [] and frames[-1]["usage"]["completion_tokens"] == 12
