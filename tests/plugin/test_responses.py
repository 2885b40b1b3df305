"""``/v1/responses`` (OpenAI's Responses API) driven by the official openai client, whose stream
helper rebuilds the response from the events and refuses out-of-order ones: greedy answers equal
the offline ``LLM.chat`` of the same conversation (the real engine on the tiny model), and, on a
scripted fake engine, reasoning, text and function calls become output items in order, streamed
and whole alike, conversations carry over through ``previous_response_id``, and what cannot be
served is a 400 naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from plugin_fake_engine import ScriptedLLM, say
from plugin_support import ServerThread, wait_until

from lorastar.plugin import LoraStarConfig, create_app

MESSAGES = [{"role": "user", "content": "Name three colours."}]
WEATHER_ARGS = {"city": "Paris", "unit": "°C"}
CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": '
    + json.dumps(WEATHER_ARGS, ensure_ascii=False)
    + "}\n</tool_call>"
)
ANSWER = "<think>need weather</think>Let me check." + CALL
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]


def greedy(max_tokens: int) -> Any:
    from lorastar import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def items_of(response: Any) -> list[tuple[Any, ...]]:
    """A response's output without its ids: (type, text | name, arguments, status)."""
    out: list[tuple[Any, ...]] = []
    for item in response.output:
        if item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content)))
        elif item.type == "message":
            out.append(("message", "".join(c.text for c in item.content), item.status))
        else:
            out.append(("function_call", item.name, item.arguments, item.status))
    return out


def streamed(client: openai.OpenAI, **kw: Any) -> tuple[Any, list[Any]]:
    """The stream's final response as the client rebuilt it, and its events."""
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = (
            stream.get_final_response() if events[-1].type == "response.completed" else events[-1].response
        )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    return final, events


# ----------------------------------------------------------------------------- the real engine


@pytest.fixture(scope="module")
def client(real_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("model", ["tiny", "alpha"])
def test_greedy_responses_equal_offline_chat(client: openai.OpenAI, offline_llm: Any, model: str) -> None:
    adapter = None if model == "tiny" else model
    system = {"role": "system", "content": "Be brief."}
    want = offline_llm.chat([system, *MESSAGES], greedy(12), adapter=adapter)[0]
    kw = {"model": model, "instructions": "Be brief.", "max_output_tokens": 12, "temperature": 0}
    got = client.responses.create(input=MESSAGES[0]["content"], **kw)
    out = want.outputs[0]
    assert got.output_text == out.text and got.model == model and got.object == "response"
    assert got.usage.input_tokens == len(want.prompt_token_ids)
    assert got.usage.output_tokens == len(out.token_ids)
    assert got.usage.total_tokens == got.usage.input_tokens + got.usage.output_tokens
    if out.finish_reason == "length":  # OpenAI's shape of a cut answer
        assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    else:
        assert got.status == "completed" and got.incomplete_details is None
    # The same conversation as items with content parts; and streamed.
    parts = [
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": MESSAGES[0]["content"]}],
        }
    ]
    assert client.responses.create(input=parts, **kw).output_text == out.text
    final, events = streamed(client, input=parts, **kw)
    assert final.output_text == out.text and items_of(final) == items_of(got)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == out.text
    assert final.usage.output_tokens == got.usage.output_tokens


def test_text_format_json_schema_decodes_under_the_schema(client: openai.OpenAI) -> None:
    # an answer the random model cannot pad with whitespace: it must end within the cap
    schema = {"enum": ["red", "green", "blue", {"colour": "teal"}]}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    got = client.responses.create(
        model="tiny", input="Give me a thing.", text={"format": fmt}, max_output_tokens=60, temperature=0
    )
    jsonschema.validate(json.loads(got.output_text), schema)
    assert got.status == "completed" and got.text.format.type == "json_schema"
    # the chat route's response_format, the same pipeline, gives the same answer
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Give me a thing."}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}},
    )  # fmt: skip
    assert chat.choices[0].message.content == got.output_text


# ----------------------------------------------------------------------------- a scripted engine


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, tuple[openai.OpenAI, ScriptedLLM]]]:
    tools, plain = ScriptedLLM(max_model_len=1024), ScriptedLLM(max_model_len=1024)
    tools_cfg = LoraStarConfig(
        async_engine=tools,
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
        responses_store_size=3,
    )
    with (
        ServerThread(create_app(tools_cfg)) as a,
        ServerThread(create_app(LoraStarConfig(async_engine=plain))) as b,
    ):
        yield {
            "tools": (openai.OpenAI(base_url=a.url + "/v1", api_key="x", max_retries=0), tools),
            "plain": (openai.OpenAI(base_url=b.url + "/v1", api_key="x", max_retries=0), plain),
        }


def test_reasoning_text_and_calls_become_output_items_streamed_and_whole(servers: dict) -> None:
    client, _ = servers["tools"]
    kw = {"model": "fake-model", "input": say(ANSWER), "max_output_tokens": len(ANSWER), "tools": TOOLS}
    whole = client.responses.create(**kw)
    assert items_of(whole) == [
        ("reasoning", "need weather"),
        ("message", "Let me check.", "completed"),
        # the fake runs to max_output_tokens: the answer was cut in its last item
        ("function_call", "get_weather", json.dumps(WEATHER_ARGS, ensure_ascii=False), "incomplete"),
    ]
    call = whole.output[2]
    assert call.call_id.startswith("chatcmpl-tool-") and call.id.startswith("fc_")
    assert whole.output[0].id.startswith("rs_") and whole.output[1].id.startswith("msg_")
    # "<think>need weather</think>": one token a character here
    assert whole.usage.output_tokens_details.reasoning_tokens == len("<think>need weather</think>")
    assert whole.tool_choice == "auto" and whole.tools[0].name == "get_weather"

    final, events = streamed(client, **kw)
    assert items_of(final) == items_of(whole)
    kinds = [e.type for e in events]
    # one item at a time, in the answer's order: reasoning, text, the call
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert kinds.index("response.output_text.done") < kinds.index("response.function_call_arguments.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "need weather"
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1, 2]
    assert events[-1].type == "response.incomplete"
    assert (
        final.usage.output_tokens_details.reasoning_tokens
        == whole.usage.output_tokens_details.reasoning_tokens
    )


def test_a_named_tool_choice_streams_its_arguments_as_they_come(servers: dict) -> None:
    client, fake = servers["plain"]
    args = '{"city": "Paris"}'
    kw = {
        "model": "fake-model", "input": say(args), "max_output_tokens": len(args), "tools": TOOLS,
        "tool_choice": {"type": "function", "name": "get_weather"},
    }  # fmt: skip
    whole = client.responses.create(**kw)
    assert items_of(whole) == [("function_call", "get_weather", args, "incomplete")]
    assert json.loads(fake.last_params.guided_json) == TOOLS[0]["parameters"]
    final, events = streamed(client, **kw)
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) == len(args) and "".join(pieces) == args  # one character a token
    assert items_of(final) == items_of(whole)


def test_a_named_tool_choice_after_thinking_is_a_reasoning_item_then_the_call(servers: dict) -> None:
    client, fake = servers["tools"]  # reasoning_parser="qwen3"
    args = '{"city": "Paris"}'
    answer = "<think>need weather</think>\n\n" + args
    kw = {
        "model": "fake-model", "input": say(answer), "max_output_tokens": len(answer), "tools": TOOLS,
        "tool_choice": {"type": "function", "name": "get_weather"},
    }  # fmt: skip
    whole = client.responses.create(**kw)
    assert items_of(whole) == [
        ("reasoning", "need weather"),
        ("function_call", "get_weather", args, "incomplete"),
    ]
    assert whole.usage.output_tokens_details.reasoning_tokens == len("<think>need weather</think>")
    final, events = streamed(client, **kw)
    assert items_of(final) == items_of(whole)
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == args
    # the stored turn (streamed or not) is the thinking and the call with its arguments
    for done in (whole, final):
        client.responses.create(
            model="fake-model", input="ok", previous_response_id=done.id, max_output_tokens=1
        )
        turn = fake.rendered[-1][0][1]
        assert turn["reasoning_content"] == "need weather" and turn["tool_calls"][0]["function"] == {
            "name": "get_weather", "arguments": {"city": "Paris"}
        }  # fmt: skip


def test_logprobs_stream_with_the_text_they_belong_to(servers: dict) -> None:
    client, _ = servers["plain"]
    kw = {"model": "fake-model", "input": say("hello"), "max_output_tokens": 5, "top_logprobs": 1,
          "include": ["message.output_text.logprobs"]}  # fmt: skip
    whole = client.responses.create(**kw)
    lps = whole.output[0].content[0].logprobs
    assert [lp.token for lp in lps] == list("hello") and [t.token for t in lps[0].top_logprobs] == ["h"]
    _, events = streamed(client, **kw)
    sent = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.model_dump() for lp in sent] == [lp.model_dump() for lp in lps]


def test_input_items_reach_the_template_as_chat_messages(servers: dict) -> None:
    client, fake = servers["tools"]
    items = [
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look up"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps(WEATHER_ARGS)},
        {"type": "function_call_output", "call_id": "call_1", "output": "21"},
    ]  # fmt: skip
    client.responses.create(model="fake-model", input=items, instructions="Be kind.", max_output_tokens=2)
    messages, _ = fake.rendered[-1]
    assert messages == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "look up", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": WEATHER_ARGS}}]},
        {"role": "tool", "content": "21", "tool_call_id": "call_1"},
    ]  # fmt: skip


def test_previous_response_id_carries_the_conversation(servers: dict) -> None:
    client, fake = servers["tools"]
    first = client.responses.create(
        model="fake-model", input=say("Hi there."), instructions="One.", max_output_tokens=9
    )
    assert first.store is True and first.output_text == "Hi there."
    second = client.responses.create(
        model="fake-model",
        input="And?",
        previous_response_id=first.id,
        max_output_tokens=2,
        instructions="Two.",
    )
    messages, _ = fake.rendered[-1]
    # the earlier answer as the assistant turn; the earlier instructions are not carried over (OpenAI's rule)
    assert messages == [
        {"role": "system", "content": "Two."},
        {"role": "user", "content": say("Hi there.")},
        {"role": "assistant", "content": "Hi there."},
        {"role": "user", "content": "And?"},
    ]
    assert second.previous_response_id == first.id
    # a streamed answer is stored too; its calls are the next turn's tool calls
    final, _ = streamed(client, model="fake-model", input=say(CALL), tools=TOOLS, max_output_tokens=len(CALL),
                        previous_response_id=second.id)  # fmt: skip
    client.responses.create(
        model="fake-model", input="ok", previous_response_id=final.id, max_output_tokens=1
    )
    messages, _ = fake.rendered[-1]
    assert [m["role"] for m in messages] == [
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert messages[5]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": WEATHER_ARGS}
    assert messages[5]["tool_calls"][0]["id"] == final.output[0].call_id

    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
    client.responses.delete(second.id)  # 404 (raised) when it is not there
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="fake-model", input="x", previous_response_id=second.id)
    assert err.value.body["param"] == "previous_response_id"
    # least recently used first: three kept
    ids = [client.responses.create(model="fake-model", input="x", max_output_tokens=1).id for _ in range(3)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    assert [client.responses.retrieve(i).id for i in ids] == ids
    not_stored = client.responses.create(model="fake-model", input="x", max_output_tokens=1, store=False)
    assert not_stored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(not_stored.id)


def test_a_call_cut_by_max_output_tokens_carries_over_as_text(servers: dict) -> None:
    client, fake = servers["tools"]
    cut = '{"city": "Par'  # a forced call's arguments, cut mid-object: no JSON
    kw: dict[str, Any] = dict(
        model="fake-model", input=say(cut), tools=TOOLS, max_output_tokens=len(cut),
        tool_choice={"type": "function", "name": "get_weather"},
    )  # fmt: skip
    for first in (client.responses.create(**kw), streamed(client, **kw)[0]):
        assert first.status == "incomplete"
        assert items_of(first) == [("function_call", "get_weather", cut, "incomplete")]
        # its output continues the conversation (it was a 400 blaming input[1], never sent)
        output = {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "42"}
        client.responses.create(
            model="fake-model", input=[output], previous_response_id=first.id, max_output_tokens=2
        )
        messages, _ = fake.rendered[-1]
        assert messages[-2]["role"] == "assistant" and messages[-2]["content"] == cut
        assert not messages[-2].get("tool_calls")
        assert messages[-1]["role"] == "tool" and messages[-1]["content"] == "42"


def test_without_a_store_previous_response_id_is_a_404_that_says_why(servers: dict) -> None:
    client, _ = servers["plain"]
    r = client.responses.create(model="fake-model", input="x", max_output_tokens=1)
    assert r.store is False  # the server keeps none (responses_store_size=0)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="fake-model", input="x", previous_response_id=r.id)
    assert "responses_store_size" in err.value.message


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools", "tools[0]: tools of type 'web_search'"),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0] needs a name"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "input[0].content[0]: only text parts",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference' are not supported"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input", "input[0] needs 'call_id'"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input", "input[0].role"),
        ({"input": []}, "input", "input must not be empty"),
        ({"background": True}, "background", "background is not supported"),
        ({"truncation": "auto"}, "truncation", "truncation 'auto'"),
        ({"conversation": "conv_1"}, "conversation", "conversation is not supported"),
        ({"max_output_tokens": 0}, "max_output_tokens", ""),
        ({"max_output_tokens": 5000}, "max_output_tokens", "'max_output_tokens' is too large"),
        ({"text": {"format": {"type": "yaml"}}}, "text", "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs a 'schema'"),
        # the engine's own check of the schema, named as this route's client sent it
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
            "text",
            "text.format",
        ),
        ({"tool_choice": {"type": "web_search"}, "tools": TOOLS}, "tool_choice", "tool_choice must be"),
        (
            {"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS},
            "tool_choice",
            "not in tools",
        ),
        ({"tools": [], "tool_choice": "required"}, "tools", "tools must not be empty"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16 pairs"),
        ({"top_logprobs": 21}, "top_logprobs", ""),
        ({"model": "nope"}, "model", "does not exist"),
    ],
)
def test_what_cannot_be_served_is_a_4xx_naming_the_field(
    servers: dict, extra: dict[str, Any], param: str, message: str
) -> None:
    client, fake = servers["tools"]
    body = {"model": "fake-model", "input": "x", "max_output_tokens": 2, **extra}
    r = httpx.post(str(client.base_url) + "responses", json=body, timeout=30)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert wait_until(lambda: not fake.running)


def test_an_error_mid_stream_is_an_error_event(servers: dict) -> None:
    client, fake = servers["plain"]
    fake.fail_after = 3
    try:
        with httpx.stream(
            "POST", str(client.base_url) + "responses", timeout=30,
            json={"model": "fake-model", "input": "abcdef", "max_output_tokens": 6, "stream": True},
        ) as r:  # fmt: skip
            lines = [x for x in r.iter_lines() if x]
    finally:
        fake.fail_after = None
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: ")]
    names = [x[7:] for x in lines if x.startswith("event: ")]
    assert names == [e["type"] for e in events] and names[-1] == "error"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "secret" not in events[-1]["message"]  # internal details stay in the server's log
    assert client.responses.create(model="fake-model", input="ab", max_output_tokens=2).output_text == "ba"


def test_the_openapi_document_describes_typed_event_streams(servers: dict) -> None:
    """/responses and /messages stream `event:` + `data:` frames without [DONE]; chat and
    completions `data:` frames ending in [DONE]: the document says which."""
    client, _ = servers["plain"]
    doc = httpx.get(str(client.base_url).removesuffix("/v1/") + "/schema/openapi.json", timeout=30).json()

    def stream_schema(path: str) -> dict[str, Any]:
        return doc["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]

    for path, event in (("/v1/responses", "ResponseStreamEvent"), ("/v1/messages", "MessagesStreamEvent")):
        schema = stream_schema(path)
        assert schema["required"] == ["event", "data"], path
        assert schema["properties"]["data"]["contentSchema"] == {"$ref": f"#/components/schemas/{event}"}
    assert "[DONE]" in json.dumps(stream_schema("/v1/chat/completions"))
