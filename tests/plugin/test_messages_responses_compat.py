"""``/v1/messages`` and ``/v1/responses`` against the official SDKs' types: valid requests
the APIs define are served, answers parse as the SDKs type them, and 400s name what the client sent."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from openai.types.responses import Response
from plugin_fake_engine import ScriptedLLM, say
from plugin_support import ServerThread

from lorastar.plugin import LoraStarConfig, create_app

TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, ScriptedLLM]]:
    fake = ScriptedLLM(max_model_len=1024)
    cfg = LoraStarConfig(
        async_engine=fake,
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
        responses_store_size=4,
    )
    with ServerThread(create_app(cfg)) as srv:
        yield srv.url, fake


# ----------------------------------------------------------------------------- /v1/messages


@pytest.mark.parametrize("kind", ["adaptive", "between_tools"])
def test_thinking_types_of_the_current_api_are_served(server: tuple[str, ScriptedLLM], kind: str) -> None:
    """Anthropic's ``thinking`` also takes ``adaptive`` (the model decides how much to think, what
    Claude Code sends to newer models) and ``between_tools``: thinking on, never a 400."""
    url, fake = server
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    kw: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    message = client.messages.create(**kw, max_tokens=2, extra_body={"thinking": {"type": kind}})
    assert message.stop_reason == "max_tokens"
    assert fake.template_kwargs == {"enable_thinking": True}
    client.messages.count_tokens(**kw, extra_body={"thinking": {"type": kind}})
    assert fake.template_kwargs == {"enable_thinking": True}  # counted as /messages renders it
    r = httpx.post(url + "/v1/messages", json={**kw, "max_tokens": 2, "thinking": {"type": "sometimes"}})
    assert r.status_code == 400 and "adaptive" in r.json()["error"]["message"]


# ----------------------------------------------------------------------------- /v1/responses


def test_responses_parse_as_the_openai_sdk_types_them(server: tuple[str, ScriptedLLM]) -> None:
    """Whole and streamed (the final event's response), the answer validates as the SDK's
    ``Response``: usage.input_tokens_details has both of its required fields."""
    url, _ = server
    body = {"model": "fake-model", "input": say("Hi."), "max_output_tokens": 3}
    whole = httpx.post(url + "/v1/responses", json=body, timeout=30).json()
    assert Response.model_validate(whole).usage.input_tokens_details.cache_write_tokens == 0
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, timeout=30) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
    final = events[-1]
    assert final["type"] in ("response.completed", "response.incomplete")
    Response.model_validate(final["response"])


def test_an_unknown_tool_choice_string_is_a_400_in_the_responses_shape(
    server: tuple[str, ScriptedLLM],
) -> None:
    url, _ = server
    body = {"model": "fake-model", "input": "x", "tools": TOOLS, "tool_choice": "sometimes"}
    r = httpx.post(url + "/v1/responses", json=body, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "tool_choice"
    # the form this API takes, not the chat API's {"type": "function", "function": {...}}
    assert "{'type': 'function', 'name': ...}" in error["message"], error


def test_a_function_call_whose_arguments_are_no_json_names_its_input_item(
    server: tuple[str, ScriptedLLM],
) -> None:
    """The 400 names the item the client sent (not the chat message it became after
    ``instructions`` and any stored conversation)."""
    url, _ = server
    items = [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{city: Paris"},
        {"type": "function_call_output", "call_id": "c1", "output": "21"},
    ]
    body = {"model": "fake-model", "input": items, "instructions": "Be brief.", "max_output_tokens": 2}
    r = httpx.post(url + "/v1/responses", json=body, timeout=30)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "input"
    assert error["message"].startswith("input[1].arguments is not JSON"), error
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    items[1]["arguments"] = '{"city": "Paris"}'
    assert client.responses.create(**{**body, "input": items}).status in ("completed", "incomplete")
