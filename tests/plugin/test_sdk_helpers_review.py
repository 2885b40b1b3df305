"""The official SDKs' higher-level helpers against the server: openai's ``parse`` (a pydantic
``response_format``, ``pydantic_function_tool``), its ``stream`` context managers and their events,
``responses.parse``/``stream`` with ``text_format``, and both SDKs' retry of a 503 after Retry-After."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pydantic
import pytest
from plugin_fake_engine import ScriptedLLM, say
from plugin_support import ServerThread

from lorastar.plugin import LoraStarConfig, create_app


class GetWeather(pydantic.BaseModel):
    city: str


def call(name: str, args: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[str, ScriptedLLM]]:
    engine = ScriptedLLM(max_model_len=2048)
    cfg = LoraStarConfig(
        async_engine=engine, enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3"
    )
    with ServerThread(create_app(cfg)) as srv:
        yield srv.url, engine


def test_chat_stream_helper_on_a_scripted_answer(fake: tuple[str, ScriptedLLM]) -> None:
    """``chat.completions.stream``: content deltas add up, ``content.done`` carries the parsed
    model, the reasoning stays out of the content, usage comes with include_usage."""
    url, _ = fake
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    answer = '{"city": "Rome"}'
    kw: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": say(f"<think>x</think>{answer}§")}],
                          "max_tokens": 200, "stop": ["§"], "response_format": GetWeather}  # fmt: skip
    with client.chat.completions.stream(**kw, stream_options={"include_usage": True}) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    deltas = [e.delta for e in events if e.type == "content.delta"]
    assert "".join(deltas) == answer
    [done] = [e for e in events if e.type == "content.done"]
    assert done.content == answer and done.parsed == GetWeather(city="Rome")
    assert final.choices[0].message.parsed == GetWeather(city="Rome") and final.usage is not None
    assert client.chat.completions.parse(**kw).choices[0].message.parsed == GetWeather(city="Rome")


def test_responses_parse_and_stream_read_text_format_and_function_tools(
    fake: tuple[str, ScriptedLLM],
) -> None:
    url, _ = fake
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    kw: dict[str, Any] = {"model": "fake-model", "max_output_tokens": 200, "extra_body": {"stop": ["§"]}}
    text = '<think>x</think>{"city": "Paris"}§'
    assert client.responses.parse(input=say(text), text_format=GetWeather, **kw).output_parsed == GetWeather(
        city="Paris"
    )
    with client.responses.stream(input=say(text), text_format=GetWeather, **kw) as stream:
        [done] = [e for e in stream if e.type == "response.output_text.done"]
        final = stream.get_final_response()
    assert done.parsed == final.output_parsed == GetWeather(city="Paris")
    # a chat-shaped pydantic_function_tool: the SDK sends it in the Responses shape
    calls = "Sure." + call("GetWeather", {"city": "Rome"}) + "§"
    tool = openai.pydantic_function_tool(GetWeather)
    got = client.responses.parse(input=say(calls), tools=[tool], **kw)
    [fc] = [o for o in got.output if o.type == "function_call"]
    assert fc.parsed_arguments == GetWeather(city="Rome") and got.output_text == "Sure."


def test_chat_stream_helper_closes_every_auto_tool_call(fake: tuple[str, ScriptedLLM]) -> None:
    """One ``tool_calls.function.arguments.done`` per call (what agents loop on): the SDK closes a
    call when the next index starts, or on a later chunk's finish_reason."""
    url, _ = fake
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    answer = "Sure." + call("GetWeather", {"city": "Paris"}) + call("GetWeather", {"city": "Rome"}) + "§"
    tool = openai.pydantic_function_tool(GetWeather)
    with client.chat.completions.stream(
        model="fake-model", messages=[{"role": "user", "content": say(answer)}], tools=[tool],
        max_tokens=400, stop=["§"],
    ) as stream:  # fmt: skip
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and len(final.message.tool_calls or []) == 2
    assert [(e.index, e.parsed_arguments) for e in done] == [
        (0, GetWeather(city="Paris")),
        (1, GetWeather(city="Rome")),
    ]


def test_both_sdks_retry_a_503_after_its_retry_after(fake: tuple[str, ScriptedLLM]) -> None:
    """A restarting engine's 503 (Retry-After: 1): each SDK's typed error without retries, and with
    them one retry that is served (the engine is back once the client has seen the 503)."""
    url, engine = fake

    def back(response: Any) -> None:  # an httpx2.Response (the SDKs' httpx)
        if response.status_code == 503:
            engine.restarting = False

    msgs = [{"role": "user", "content": say("ok§")}]
    kw: dict[str, Any] = {"model": "fake-model", "messages": msgs, "max_tokens": 8, "stop": ["§"]}
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    an = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    engine.restarting = True
    try:
        with pytest.raises(openai.APIStatusError) as e:
            oa.chat.completions.create(**kw)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        with pytest.raises(anthropic.APIStatusError) as e2:
            an.messages.create(model="fake-model", messages=msgs, max_tokens=8, stop_sequences=["§"])
        assert e2.value.status_code == 503 and e2.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        oa = openai.OpenAI(
            base_url=url + "/v1", api_key="x", max_retries=1,
            http_client=openai.DefaultHttpxClient(event_hooks={"response": [back]}),
        )  # fmt: skip
        raw = oa.chat.completions.with_raw_response.create(**kw)
        assert raw.retries_taken == 1 and raw.parse().choices[0].message.content == "ok"
        engine.restarting = True
        hooks = {"response": [back]}
        an = anthropic.Anthropic(
            base_url=url,
            api_key="x",
            max_retries=1,
            http_client=anthropic.DefaultHttpxClient(event_hooks=hooks),
        )
        with an.messages.stream(model="fake-model", messages=msgs, max_tokens=8, stop_sequences=["§"]) as s:
            assert "".join(s.text_stream) == "ok"
    finally:
        engine.restarting = False
