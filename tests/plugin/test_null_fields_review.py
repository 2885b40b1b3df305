"""What real clients send for optional fields: explicit ``null`` (LangChain, LiteLLM, pydantic-dumped
bodies), "empty" defaults (``0``, ``[]``, ``{}``) and fields of newer API versions. Each is served as
vLLM serves it: a null means "unset" (the engine gets what an absent field gives), an empty default
asks for nothing, an unknown field is ignored."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from plugin_fake_engine import ScriptedLLM, say
from plugin_support import ServerThread

from lorastar.plugin import LoraStarConfig, create_app

MESSAGES = [{"role": "user", "content": say("Hi there.")}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, ScriptedLLM]]:
    fake = ScriptedLLM(max_model_len=1024)
    cfg = LoraStarConfig(async_engine=fake, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with ServerThread(create_app(cfg)) as srv:
        yield srv.url, fake


def _params(url: str, fake: ScriptedLLM, route: str, body: dict[str, Any]) -> dict[str, Any]:
    """The engine's parameters of one plain request (a 200 asserted)."""
    r = httpx.post(url + route, json={"model": "fake-model", **body}, timeout=20)
    assert r.status_code == 200, r.text
    return fake.last_params.to_dict()


# Optional fields as clients send them unset: each must reach the engine as the absent field does.
CHAT_UNSET = [
    {"n": None},
    {"stop": None},
    {"stop": []},
    {"logit_bias": None},
    {"logit_bias": {}},
    {"seed": None},
    {"max_completion_tokens": None},
    {"temperature": None},
    {"top_p": None},
    {"top_k": None},
    {"presence_penalty": None},
    {"frequency_penalty": None},
    {"user": None},
    {"tools": None, "tool_choice": None},
    {"tools": [], "tool_choice": "none"},
    {"response_format": None},
    {"response_format": {"type": "text"}},
    {"logprobs": False, "top_logprobs": 0},
    {"logprobs": None, "top_logprobs": 0},
    {"logprobs": False, "top_logprobs": None},
    {"parallel_tool_calls": None},
    {"stream_options": None},
    {"stream_options": {}},  # vLLM tests the raw object: empty passes without stream
    {"prompt_logprobs": None},
    {"stop_token_ids": []},
    {"bad_words": []},
    # OpenAI's newer fields and the legacy function API: ignored, as vLLM ignores them
    {"metadata": {"k": "v"}, "store": False, "service_tier": "auto", "modalities": ["text"], "audio": None},
    {"prediction": {"type": "content", "content": "x"}, "reasoning_effort": None, "web_search_options": None},
    {"functions": [{"name": "f", "parameters": {}}], "function_call": "auto"},
    {"a_field_no_server_knows": 1},
]


@pytest.mark.parametrize(
    "unset", CHAT_UNSET, ids=lambda d: ",".join(f"{k}={json.dumps(v)}" for k, v in d.items())
)
def test_chat_unset_fields_reach_the_engine_as_absent_ones(
    server: tuple[str, ScriptedLLM], unset: dict[str, Any]
) -> None:
    url, fake = server
    body = {"messages": MESSAGES, "max_tokens": 4}
    assert _params(url, fake, "/v1/chat/completions", {**body, **unset}) == _params(
        url, fake, "/v1/chat/completions", body
    )


def test_chat_n_null_is_one_choice(server: tuple[str, ScriptedLLM]) -> None:
    """vLLM's chat ``n`` is ``int | None = 1`` (``SamplingParams.from_optional``): null is one choice."""
    url, fake = server
    for stream in (False, True):
        body = {"model": "fake-model", "messages": MESSAGES, "max_tokens": 3, "n": None, "stream": stream}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=20)
        assert r.status_code == 200, r.text
        assert fake.last_params.n == 1
        if not stream:
            assert [c["index"] for c in r.json()["choices"]] == [0]


def test_top_logprobs_zero_without_logprobs_asks_for_nothing(server: tuple[str, ScriptedLLM]) -> None:
    """vLLM refuses ``top_logprobs`` without ``logprobs`` only when it asks for some (> 0 or -1): the 0
    clients send as their default is served, without logprobs."""
    url, fake = server
    for logprobs in (False, None):
        body = {
            "model": "fake-model",
            "messages": MESSAGES,
            "max_tokens": 3,
            "logprobs": logprobs,
            "top_logprobs": 0,
        }
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=20)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"] is None and fake.last_params.logprobs is None
    r = httpx.post(url + "/v1/chat/completions", json={**body, "top_logprobs": 2}, timeout=20)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/completions", {"prompt": "hello"}),
    ],
)
def test_prompt_logprobs_zero_in_a_stream_is_served(
    server: tuple[str, ScriptedLLM], route: str, body: dict[str, Any]
) -> None:
    """vLLM refuses ``prompt_logprobs`` in a stream only when it asks for some (> 0 or -1); 0 is
    served, and the engine computes none (a stream would not carry them)."""
    url, fake = server
    body = {"model": "fake-model", "max_tokens": 2, "stream": True, **body}
    with httpx.stream("POST", url + route, json={**body, "prompt_logprobs": 0}, timeout=20) as r:
        assert r.status_code == 200, r.read()
        assert [line for line in r.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"
    assert fake.last_params.prompt_logprobs is None
    r = httpx.post(url + route, json={**body, "prompt_logprobs": 1}, timeout=20)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_completions_null_fields_and_echo_scoring(server: tuple[str, ScriptedLLM]) -> None:
    """Completions' nulls (``max_tokens`` null: vLLM's 16) and lm-eval's scoring body (echo,
    ``max_tokens`` 0, ``logprobs`` 0 or 1) as the absent fields give."""
    url, fake = server
    body = {"prompt": "hello", "max_tokens": 4}
    base = _params(url, fake, "/v1/completions", body)
    nulls = {"stop": None, "seed": None, "temperature": None, "logprobs": None, "suffix": None, "best_of": None,
             "echo": None, "user": None, "logit_bias": {}, "response_format": None, "prompt_embeds": None}  # fmt: skip
    assert _params(url, fake, "/v1/completions", {**body, **nulls}) == base
    assert _params(url, fake, "/v1/completions", {"prompt": "hello", "max_tokens": None})["max_tokens"] == 16
    for lp in (0, 1):
        scoring = {"prompt": "hello", "max_tokens": 0, "echo": True, "logprobs": lp, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json={"model": "fake-model", **scoring}, timeout=20)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == "hello" and r.json()["usage"]["completion_tokens"] == 0
        assert fake.last_params.prompt_logprobs == lp


def test_assistant_turn_with_null_content_and_tool_calls(server: tuple[str, ScriptedLLM]) -> None:
    """OpenAI's assistant turn that only calls tools: ``content`` null, ``name`` null, an empty
    ``refusal``; its calls reach the template."""
    url, fake = server
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "x", "name": None},
        {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None, "function_call": None},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "user", "content": say("Done.")},
    ]
    body = {"model": "fake-model", "messages": messages, "tools": TOOLS, "tool_choice": None, "max_tokens": 3}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=20)
    assert r.status_code == 200, r.text
    rendered, _ = fake.rendered[-1]
    assert rendered[1]["content"] == "" and rendered[1]["tool_calls"][0]["function"]["arguments"] == {}


def test_messages_tool_result_with_null_content(server: tuple[str, ScriptedLLM]) -> None:
    """Anthropic's ``tool_result.content`` is optional: null (as absent) is an empty result, as vLLM
    reads it, not a 400."""
    url, fake = server
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    for content in (None, "absent"):
        result: dict[str, Any] = {"type": "tool_result", "tool_use_id": "t1"}
        if content != "absent":
            result["content"] = content
        messages = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [result]},
        ]
        body = {"model": "fake-model", "max_tokens": 3, "messages": messages, "tools": tools}
        r = httpx.post(url + "/v1/messages", json=body, timeout=20)
        assert r.status_code == 200, r.text
        rendered, _ = fake.rendered[-1]
        assert rendered[-1] == {"role": "tool", "content": "", "tool_call_id": "t1"}


def test_responses_and_messages_nulls_reach_the_engine_as_absent_ones(
    server: tuple[str, ScriptedLLM],
) -> None:
    url, fake = server
    body = {"input": say("Hi."), "max_output_tokens": 4}
    nulls = {"instructions": None, "temperature": None, "top_p": None, "top_logprobs": None, "include": None,
             "tools": None, "tool_choice": None, "parallel_tool_calls": None, "text": None, "reasoning": None,
             "stream": None, "store": None, "previous_response_id": None, "metadata": None, "user": None,
             "truncation": None, "service_tier": None, "background": None, "conversation": None, "prompt": None,
             "seed": None, "stop": None, "max_tool_calls": None}  # fmt: skip
    assert _params(url, fake, "/v1/responses", {**body, **nulls}) == _params(url, fake, "/v1/responses", body)
    body = {"messages": MESSAGES, "max_tokens": 4}
    nulls = {"system": None, "stop_sequences": None, "stream": None, "temperature": None, "top_p": None,
             "top_k": None, "tools": None, "tool_choice": None, "thinking": None, "metadata": {"user_id": None},
             "output_config": None, "service_tier": "auto"}  # fmt: skip
    assert _params(url, fake, "/v1/messages", {**body, **nulls}) == _params(url, fake, "/v1/messages", body)
