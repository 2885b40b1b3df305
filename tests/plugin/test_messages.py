"""``/v1/messages`` (Anthropic's Messages API) driven by the official anthropic client, whose stream
helper rebuilds the message from the events and refuses out-of-order ones: greedy answers equal the
offline ``LLM.chat`` of the same conversation (the real engine on the tiny model), and, on a
scripted fake engine, thinking, text and tool calls become content blocks in order, streamed and
whole alike, tool history reaches the template, and errors come in Anthropic's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from plugin_fake_engine import ScriptedLLM, TagTokenizer, say
from plugin_support import ServerThread, wait_until

from lorastar.plugin import LoraStarConfig, create_app

anthropic = pytest.importorskip("anthropic")

MESSAGES = [{"role": "user", "content": "Name three colours."}]
WEATHER_ARGS = {"city": "Paris", "unit": "°C"}
CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": '
    + json.dumps(WEATHER_ARGS, ensure_ascii=False)
    + "}\n</tool_call>"
)
ANSWER = "<think>need weather</think>Let me check." + CALL
TOOLS = [{"name": "get_weather", "description": "Weather now.", "input_schema": {"type": "object"}}]
GREEDY = {"temperature": 0}  # sent as an extra: the newest SDK has no temperature argument


def blocks_of(message: Any) -> list[tuple[Any, ...]]:
    """A message's content without ids: (type, text | thinking | name, input)."""
    out: list[tuple[Any, ...]] = []
    for block in message.content:
        if block.type == "text":
            out.append(("text", block.text))
        elif block.type == "thinking":
            out.append(("thinking", block.thinking))
        else:
            out.append(("tool_use", block.name, block.input))
    return out


def streamed(client: Any, **kw: Any) -> tuple[Any, list[str]]:
    """The stream's final message as the client rebuilt it, and its event types."""
    with client.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    return final, kinds


# ----------------------------------------------------------------------------- the real engine


@pytest.fixture(scope="module")
def client(real_server: ServerThread) -> Any:
    return anthropic.Anthropic(base_url=real_server.url, api_key="unused", max_retries=0)


@pytest.mark.parametrize("model", ["tiny", "alpha"])
def test_greedy_messages_equal_offline_chat(client: Any, offline_llm: Any, model: str) -> None:
    from lorastar import SamplingParams

    adapter = None if model == "tiny" else model
    system = {"role": "system", "content": "Be brief."}
    want = offline_llm.chat(
        [system, *MESSAGES], SamplingParams(temperature=0, max_tokens=12), adapter=adapter
    )[0]
    out = want.outputs[0]
    kw = {"model": model, "system": "Be brief.", "max_tokens": 12, "messages": MESSAGES, "extra_body": GREEDY}
    got = client.messages.create(**kw)
    assert blocks_of(got) == [("text", out.text)] and got.model == model and got.role == "assistant"
    assert got.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[out.finish_reason]
    # Anthropic's input_tokens leave out what was read from the prefix cache
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == len(want.prompt_token_ids)
    assert got.usage.output_tokens == len(out.token_ids)
    count = client.messages.count_tokens(model=model, system="Be brief.", messages=MESSAGES)
    assert count.input_tokens == len(want.prompt_token_ids)
    # system as text blocks, content as blocks, and streamed: the same answer
    blocks = {"system": [{"type": "text", "text": "Be brief."}],
              "messages": [{"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"]}]}]}  # fmt: skip
    assert blocks_of(client.messages.create(**{**kw, **blocks})) == blocks_of(got)
    final, kinds = streamed(client, **{**kw, **blocks})
    assert blocks_of(final) == blocks_of(got) and final.stop_reason == got.stop_reason
    assert final.usage.output_tokens == got.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == len(want.prompt_token_ids)


# ----------------------------------------------------------------------------- a scripted engine


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, tuple[Any, ScriptedLLM, str]]]:
    tools, plain = ScriptedLLM(max_model_len=1024), ScriptedLLM(max_model_len=1024)
    tools_cfg = LoraStarConfig(
        async_engine=tools, enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3"
    )
    plain_cfg = LoraStarConfig(async_engine=plain, api_keys=["key"])
    with ServerThread(create_app(tools_cfg)) as a, ServerThread(create_app(plain_cfg)) as b:
        yield {
            "tools": (anthropic.Anthropic(base_url=a.url, api_key="x", max_retries=0), tools, a.url),
            # Anthropic's SDK sends its key as x-api-key: the server's api_keys take it
            "plain": (anthropic.Anthropic(base_url=b.url, api_key="key", max_retries=0), plain, b.url),
        }


def test_thinking_text_and_tool_calls_become_blocks_streamed_and_whole(servers: dict) -> None:
    client, _, _ = servers["tools"]
    kw = {"model": "fake-model", "max_tokens": 500, "tools": TOOLS, "stop_sequences": ["§"],
          "messages": [{"role": "user", "content": say(ANSWER + "§")}]}  # fmt: skip
    whole = client.messages.create(**kw)
    assert blocks_of(whole) == [
        ("thinking", "need weather"), ("text", "Let me check."), ("tool_use", "get_weather", WEATHER_ARGS)
    ]  # fmt: skip
    assert whole.stop_reason == "tool_use" and whole.content[2].id.startswith("toolu_")
    final, kinds = streamed(client, **kw)
    assert blocks_of(final) == blocks_of(whole) and final.stop_reason == "tool_use"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 3
    # a plain answer ended by a stop sequence says which
    plain = client.messages.create(**{**kw, "messages": [{"role": "user", "content": say("Sunny.§")}]})
    assert blocks_of(plain) == [("text", "Sunny.")]
    assert (plain.stop_reason, plain.stop_sequence) == ("stop_sequence", "§")
    cut = client.messages.create(**{**kw, "max_tokens": len("<think>need ")})
    assert cut.stop_reason == "max_tokens" and blocks_of(cut) == [("thinking", "need ")]


def test_a_named_tool_streams_its_input_as_it_comes(servers: dict) -> None:
    client, fake, _ = servers["plain"]
    args = '{"city": "Paris"}'
    kw = {"model": "fake-model", "max_tokens": len(args), "tools": TOOLS,
          "tool_choice": {"type": "tool", "name": "get_weather"},
          "messages": [{"role": "user", "content": say(args)}]}  # fmt: skip
    whole = client.messages.create(**kw)
    assert blocks_of(whole) == [("tool_use", "get_weather", {"city": "Paris"})]
    assert json.loads(fake.last_params.guided_json) == TOOLS[0]["input_schema"]
    with client.messages.stream(**kw) as stream:
        pieces = [e.delta.partial_json for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert len(pieces) == len(args) and "".join(pieces) == args  # one character a token
    assert blocks_of(final) == blocks_of(whole)
    # tool_choice any: the answer is decoded under the tools' schema (the chat route's "required")
    client.messages.create(**{**kw, "tool_choice": {"type": "any"}, "max_tokens": 1})
    assert json.loads(fake.last_params.guided_json)["type"] == "array"


def test_a_named_tool_after_thinking_is_a_thinking_block_then_the_tool_use(servers: dict) -> None:
    client, _, _ = servers["tools"]  # reasoning_parser="qwen3"
    args = '{"city": "Paris"}'
    answer = "<think>need weather</think>\n\n" + args
    kw = {"model": "fake-model", "max_tokens": len(answer), "tools": TOOLS,
          "tool_choice": {"type": "tool", "name": "get_weather"},
          "messages": [{"role": "user", "content": say(answer)}]}  # fmt: skip
    whole = client.messages.create(**kw)
    assert blocks_of(whole) == [("thinking", "need weather"), ("tool_use", "get_weather", {"city": "Paris"})]
    final, kinds = streamed(client, **kw)
    assert blocks_of(final) == blocks_of(whole)
    assert kinds.count("content_block_start") == 2


def test_tool_history_reaches_the_template_as_chat_messages(servers: dict) -> None:
    client, fake, _ = servers["tools"]
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "look up", "signature": "sig"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": WEATHER_ARGS}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21"}]},
            {"type": "text", "text": "and tomorrow?"}]},
    ]  # fmt: skip
    client.messages.create(model="fake-model", max_tokens=2, system="Be kind.", tools=TOOLS, messages=history)
    messages, tools = fake.rendered[-1]
    assert messages == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "look up", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": WEATHER_ARGS}}]},
        {"role": "tool", "content": "21", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "and tomorrow?"},
    ]  # fmt: skip
    assert tools == [{"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                                       "parameters": {"type": "object"}}}]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "status", "kind", "message"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "invalid_request_error",
            "messages[0].content[0]: 'image' blocks are not supported",
        ),
        (
            {"messages": [{"role": "system", "content": "x"}]},
            400,
            "invalid_request_error",
            "messages[0].role",
        ),
        ({"messages": []}, 400, "invalid_request_error", "messages must not be empty"),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            400,
            "invalid_request_error",
            "tools[0]: tools of type 'web_search_20250305'",
        ),
        (
            {"tool_choice": {"type": "sometimes"}, "tools": TOOLS},
            400,
            "invalid_request_error",
            "tool_choice must be",
        ),
        (
            {"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS},
            400,
            "invalid_request_error",
            "not in tools",
        ),
        ({"system": [{"type": "image"}]}, 400, "invalid_request_error", "system[0]: only text blocks"),
        (
            {"output_config": {"format": {"type": "yaml"}}},
            400,
            "invalid_request_error",
            "output_config.format",
        ),
        ({"max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
        ({"max_tokens": 5000}, 400, "invalid_request_error", "'max_tokens' is too large"),
        ({"model": "nope"}, 404, "not_found_error", "does not exist"),
    ],
)
def test_what_cannot_be_served_is_an_anthropic_error(
    servers: dict, extra: dict[str, Any], status: int, kind: str, message: str
) -> None:
    _, fake, url = servers["tools"]
    body = {"model": "fake-model", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], **extra}
    r = httpx.post(url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind
    assert message in r.json()["error"]["message"], r.json()
    assert wait_until(lambda: not fake.running)


def test_thinking_switches_the_templates_enable_thinking(servers: dict) -> None:
    client, fake, _ = servers["tools"]
    kw = {"model": "fake-model", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    client.messages.create(**kw, thinking={"type": "disabled"})
    assert fake.template_kwargs == {"enable_thinking": False}
    client.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 1024})
    assert fake.template_kwargs == {"enable_thinking": True}
    # the request's own variable wins; without thinking nothing is added
    client.messages.create(
        **kw,
        thinking={"type": "disabled"},
        extra_body={"chat_template_kwargs": {"enable_thinking": True, "x": 1}},
    )
    assert fake.template_kwargs == {"enable_thinking": True, "x": 1}
    client.messages.create(**kw)
    assert fake.template_kwargs is None
    client.messages.count_tokens(model="fake-model", messages=kw["messages"], thinking={"type": "disabled"})
    assert fake.template_kwargs == {"enable_thinking": False}  # counted as /messages renders it
    with pytest.raises(anthropic.BadRequestError, match="thinking.type"):
        client.messages.create(**kw, extra_body={"thinking": {"type": "sometimes"}})


def test_thinking_budget_tokens_cap_the_thinking_where_the_server_can(servers: dict) -> None:
    """Enabled thinking's ``budget_tokens`` becomes the engine's thinking_token_budget where the
    reasoning parser's tags are one token each; otherwise it is dropped (Anthropic's clients send
    one with every thinking request), never a 400."""
    client, fake, _ = servers["tools"]  # reasoning_parser="qwen3"
    kw = {"model": "fake-model", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    inner = fake.tokenizer
    fake.tokenizer = TagTokenizer(inner)
    try:
        client.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 1024})
        p = fake.last_params
        assert (p.thinking_token_budget, p.reasoning_start_token_id, p.reasoning_end_token_id) == (
            1024,
            900,
            901,
        )
        client.messages.create(**kw, thinking={"type": "disabled"})
        assert fake.last_params.thinking_token_budget is None
        with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
            client.messages.create(
                **kw, extra_body={"thinking": {"type": "enabled", "budget_tokens": "many"}}
            )
    finally:
        fake.tokenizer = inner
    client.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 1024})  # "<think>": 7 tokens
    assert fake.last_params.thinking_token_budget is None


def test_api_keys_are_read_from_either_header(servers: dict) -> None:
    _, _, url = servers["plain"]
    body = {"model": "fake-model", "max_tokens": 2, "messages": [{"role": "user", "content": "ab"}]}
    for headers in ({"x-api-key": "key"}, {"Authorization": "Bearer key"}):
        assert httpx.post(url + "/v1/messages", json=body, headers=headers, timeout=30).status_code == 200
    r = httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": "wrong"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_an_error_mid_stream_is_an_anthropic_error_event(servers: dict) -> None:
    client, fake, url = servers["plain"]
    fake.fail_after = 3
    try:
        with httpx.stream(
            "POST", url + "/v1/messages", headers={"x-api-key": "key"}, timeout=30,
            json={"model": "fake-model", "max_tokens": 6, "stream": True,
                  "messages": [{"role": "user", "content": "abcdef"}]},
        ) as r:  # fmt: skip
            lines = [x for x in r.iter_lines() if x]
    finally:
        fake.fail_after = None
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: ")]
    names = [x[7:] for x in lines if x.startswith("event: ")]
    assert names == [e["type"] for e in events] and names[0] == "message_start" and names[-1] == "error"
    assert events[-1]["error"]["type"] == "api_error" and "secret" not in events[-1]["error"]["message"]
    assert blocks_of(
        client.messages.create(model="fake-model", max_tokens=2, messages=[{"role": "user", "content": "ab"}])
    ) == [("text", "ba")]
