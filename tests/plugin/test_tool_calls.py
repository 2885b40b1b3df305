"""Tool calling on the chat route (vLLM's ``--enable-auto-tool-choice --tool-call-parser hermes``):
the parser's answers, streams that split anywhere give the whole answer's calls, the request checks
with vLLM's messages, tools and tool-call history reaching the chat template, and the route over HTTP
(fake engine: it answers with its prompt reversed, one character a token)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plugin_fake_engine import FakeAsyncLLM, TagTokenizer
from plugin_support import ServerThread

from lorastar.plugin import LoraStarConfig, create_app
from lorastar.plugin.tool_parsers import ToolCallStream, parse_tool_calls

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _block(call: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


def _calls(text: str, parser: str = "hermes") -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(text, parser)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_whole_answers_parse_as_vllms_hermes_parser() -> None:
    two = {"name": "get_time", "arguments": {}}
    assert _calls(_block(WEATHER)) == (None, [("get_weather", WEATHER["arguments"])])
    assert _calls("Checking." + _block(WEATHER) + "\n" + _block(two)) == (
        "Checking.",
        [("get_weather", WEATHER["arguments"]), ("get_time", {})],
    )
    # the answer ended inside its last call (no closing tag): still a call
    assert _calls(_block(WEATHER) + '<tool_call>{"name": "get_time", "arguments": {}}') == (
        None,
        [("get_weather", WEATHER["arguments"]), ("get_time", {})],
    )
    assert _calls("no calls at all") == ("no calls at all", [])
    broken = "Sure <tool_call>{not json</tool_call>"
    assert _calls(broken) == (broken, [])  # nothing the model wrote is lost
    assert _calls('<tool_call>["a list"]</tool_call>')[1] == []
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert calls[0].arguments == '{"x": 1}'  # arguments already JSON text pass as they are
    assert (
        calls[0].id.startswith("chatcmpl-tool-") and calls[0].id != parse_tool_calls(_block(WEATHER))[1][0].id
    )


def test_llama3_json_answers_parse_as_calls_only_when_they_are_calls() -> None:
    params = {"name": "get_weather", "parameters": WEATHER["arguments"]}
    two = {"name": "get_time", "arguments": {}}
    want = [("get_weather", WEATHER["arguments"])]
    assert _calls(json.dumps(params), "llama3_json") == (None, want)
    assert _calls("<|python_tag|>" + json.dumps(params), "llama3_json") == (None, want)
    assert _calls(" \n" + json.dumps(params) + "; " + json.dumps(two), "llama3_json") == (
        None,
        [*want, ("get_time", {})],
    )
    for text in (
        'The JSON is {"name": "x", "parameters": {}}',  # prose quoting JSON: content, not a call
        '{"name": "x", "parameters": {}} and then some words',
        '{"city": "Paris"}',  # no name
        '{"name": "x", "parameters": {"a": 1}',  # cut off
        "<|python_tag|>print(1)",  # the code-interpreter tool, not a function call
    ):
        assert _calls(text, "llama3_json") == (text, []), text


def test_mistral_answers_parse_in_both_of_its_formats() -> None:
    args = WEATHER["arguments"]
    want = [("get_weather", args)]
    for text in (
        "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(args),  # v11+ (Small 3.x, Ministral 3)
        "[TOOL_CALLS]get_weather" + json.dumps(args),
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + json.dumps(args) + "}]",  # before v11
    ):
        assert _calls(text, "mistral") == (None, want), text
    assert _calls(
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "°C"}[TOOL_CALLS]get_time[ARGS]{}',
        "mistral",
    ) == (
        "Sure.",
        [*want, ("get_time", {})],
    )
    for text in (
        "[TOOL_CALLS]get_weather[ARGS]{broken",
        '[TOOL_CALLS]{"city": 1}',
        "[TOOL_CALLS][1, 2]",
        "no calls",
    ):
        assert _calls(text, "mistral") == (text, []), text
    ids = {c.id for c in parse_tool_calls("[TOOL_CALLS]f{}[TOOL_CALLS]g{}", "mistral")[1]}
    assert len(ids) == 2 and all(len(i) == 9 and i.isalnum() for i in ids)  # Mistral's templates check this


_PIECES = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool", "_call>", "<", "text ", "\n", '{"name": "f", "arguments": {}}', "{"],
    "mistral": ["[TOOL_CALLS]", "[TOOL", "_CALLS]", "[", "f", "[ARGS]", '{"a": 1}', '[{"name": "g", "arguments": {}}]', " ", "x"],
    "llama3_json": ["<|python_tag|>", "<|py", "thon_tag|>", " ", "\n", "; ", "text", '{"name": "f", "parameters": {}}', "{", "}"],
    "pythonic": ["[", "]", "f(", ")", "a=1", ", ", "g()", " ", "<|python_start|>", "<|python_", "text", "x='y'"],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=f>", "</function>", "<parameter=a>", "</parameter>", "\n", "1", "x ", "<"],
}  # fmt: skip


QWEN_TOOLS = [{"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "nights": {"type": "integer"}, "price": {"type": "number"}, "pets": {"type": "boolean"},
    "rooms": {"type": "array"}, "extra": {"type": "object"}, "note": {"type": "string"}}}}}]  # fmt: skip


def test_qwen3_coder_answers_parse_with_values_typed_by_the_schema() -> None:
    """Qwen3-Coder's XML calls, typed as vLLM's qwen3_coder parser types them: by the tool's schema,
    text where the schema says string, lacks the parameter, or the value does not parse."""
    call = (
        "<tool_call>\n<function=book>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=nights>\n3\n</parameter>\n<parameter=price>\n99.5\n</parameter>\n"
        "<parameter=pets>\nTrue\n</parameter>\n<parameter=rooms>\n[1, 2]\n</parameter>\n"
        "<parameter=extra>\n{'view': 'sea'}\n</parameter>\n<parameter=note>\n42\n</parameter>\n"
        "<parameter=unknown>\n7\n</parameter>\n</function>\n</tool_call>"
    )
    content, calls = parse_tool_calls("Booking.\n\n" + call, "qwen3_coder", QWEN_TOOLS)
    assert content == "Booking.\n\n" and [c.name for c in calls] == ["book"]
    assert json.loads(calls[0].arguments) == {
        "city": "New York", "nights": 3, "price": 99.5, "pets": True, "rooms": [1, 2],
        "extra": {"view": "sea"}, "note": "42", "unknown": "7",
    }  # fmt: skip
    two = (
        call.replace("book", "other")
        + "\n"
        + "<tool_call>\n<function=book>\n<parameter=nights>\nmany\n</parameter>\n"
    )
    content, calls = parse_tool_calls(two, "qwen3_coder", QWEN_TOOLS)  # the last call cut short
    assert content is None and [c.name for c in calls] == ["other", "book"]
    assert json.loads(calls[0].arguments)["nights"] == "3"  # no schema for "other": text
    assert json.loads(calls[1].arguments) == {"nights": "many"}  # not an integer: kept as text
    nulls = "<tool_call><function=book><parameter=price>null</parameter><parameter=nights>inf</parameter></function></tool_call>"
    assert json.loads(parse_tool_calls(nulls, "qwen3_coder", QWEN_TOOLS)[1][0].arguments) == {
        "price": None,
        "nights": "inf",
    }
    odd = "<tool_call><function=book><parameter=rooms>[1e999]</parameter><parameter=extra>{1, 2}</parameter></function></tool_call>"
    got = json.loads(parse_tool_calls(odd, "qwen3_coder", QWEN_TOOLS)[1][0].arguments)
    assert got == {"rooms": "[1e999]", "extra": "{1, 2}"}  # not finite JSON (a set): kept as text
    for text in ("no calls", "<tool_call><function=>x</function></tool_call>", "<tool_call>junk</tool_call>"):
        assert _calls(text, "qwen3_coder") == (text, []), text


@settings(max_examples=300, deadline=None)
@given(data=st.data(), parser=st.sampled_from(sorted(_PIECES)), cuts=st.lists(st.integers(0, 80), max_size=8))
def test_a_stream_split_anywhere_gives_the_whole_answers_calls(
    data: st.DataObject, parser: str, cuts: list[int]
) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(_PIECES[parser]), max_size=10)))
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    stream = ToolCallStream(parser)
    content, calls = "", []
    for i, d in enumerate(deltas):
        c, got = stream.feed(d, final=i == len(deltas) - 1)
        content += c
        calls += got
    want_content, want_calls = parse_tool_calls(text, parser)
    assert content == (want_content or "")
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tool_call_parser": "python"}, "tool_call_parser"),
        ({"enable_auto_tool_choice": True}, "tool_call_parser"),
    ],
)
def test_config_refuses_what_it_cannot_parse(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LoraStarConfig(**kwargs)


ANSWER = "<think>need weather</think>Let me check." + _block(WEATHER)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, tuple[httpx.Client, FakeAsyncLLM]]]:
    tools_on, plain, llama, mistral, qwen = (FakeAsyncLLM(max_model_len=1024) for _ in range(5))
    on = LoraStarConfig(
        async_engine=tools_on,
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
    )
    llama3 = LoraStarConfig(async_engine=llama, enable_auto_tool_choice=True, tool_call_parser="llama3_json")
    mistral_cfg = LoraStarConfig(
        async_engine=mistral, enable_auto_tool_choice=True, tool_call_parser="mistral"
    )
    qwen_cfg = LoraStarConfig(async_engine=qwen, enable_auto_tool_choice=True, tool_call_parser="qwen3_coder")
    with (
        ServerThread(create_app(on)) as a,
        ServerThread(create_app(LoraStarConfig(async_engine=plain))) as b,
        ServerThread(create_app(llama3)) as c,
        ServerThread(create_app(mistral_cfg)) as d,
        ServerThread(create_app(qwen_cfg)) as e,
        httpx.Client(base_url=a.url, timeout=30) as ca,
        httpx.Client(base_url=b.url, timeout=30) as cb,
        httpx.Client(base_url=c.url, timeout=30) as cc,
        httpx.Client(base_url=d.url, timeout=30) as cd,
        httpx.Client(base_url=e.url, timeout=30) as ce,
    ):
        yield {"on": (ca, tools_on), "plain": (cb, plain), "llama3": (cc, llama), "mistral": (cd, mistral),
               "qwen3_coder": (ce, qwen)}  # fmt: skip


def _chat(**extra: Any) -> dict[str, Any]:
    # The fake answers with the rendered prompt ("<user>" + content) reversed: exactly ANSWER here.
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": ANSWER[::-1]}],
        "add_generation_prompt": False,
        "max_tokens": len(ANSWER),
        "tools": TOOLS,
        **extra,
    }


def _stream_deltas(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every choice delta of ``body`` streamed from the chat route."""
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        return [
            ch["delta"]
            for x in resp.iter_lines()
            if x.startswith("data: ") and x != "data: [DONE]"
            for ch in json.loads(x[6:])["choices"]
        ]


def test_answers_carry_the_calls(servers: dict) -> None:
    http, fake = servers["on"]
    choice = http.post("/v1/chat/completions", json=_chat()).json()["choices"][0]
    msg = choice["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("need weather", "Let me check.")
    [call] = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == WEATHER["arguments"]
    assert choice["finish_reason"] == "tool_calls"
    assert fake.rendered[-1][1] == TOOLS  # the template got the tools
    # tool_choice "none": the tools still reach the template, the answer is left as written
    msg = http.post("/v1/chat/completions", json=_chat(tool_choice="none")).json()["choices"][0]["message"]
    assert msg["tool_calls"] == [] and msg["content"] == "Let me check." + _block(WEATHER)


def test_streams_send_the_calls_whole_in_the_last_delta(servers: dict) -> None:
    http, _ = servers["on"]
    frames = []
    with http.stream("POST", "/v1/chat/completions", json=_chat(stream=True)) as resp:
        assert resp.status_code == 200
        frames = [
            json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"
        ]
    deltas = [ch["delta"] for f in frames for ch in f["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "need weather"
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == WEATHER["arguments"]
    # the calls whole in the last delta, then (as OpenAI sends it) a chunk that only ends the choice:
    # the openai SDK's stream helper never closed a call that came in the chunk with finish_reason
    assert (
        frames[-2]["choices"][0]["finish_reason"] is None
        and "tool_calls" in frames[-2]["choices"][0]["delta"]
    )
    assert (
        frames[-1]["choices"][0]["finish_reason"] == "tool_calls" and frames[-1]["choices"][0]["delta"] == {}
    )


def test_tool_call_history_reaches_the_template_with_parsed_arguments(servers: dict) -> None:
    http, fake = servers["on"]
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(WEATHER["arguments"])}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21"},
    ]  # fmt: skip
    r = http.post("/v1/chat/completions", json={"model": "fake-model", "messages": history, "max_tokens": 2})
    assert r.status_code == 200, r.text
    messages, tools = fake.rendered[-1]
    assert tools is None
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == WEATHER["arguments"]  # an object
    assert messages[2] == {"role": "tool", "content": "21", "tool_call_id": "call_1"}
    bad = json.loads(json.dumps(history))
    bad[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    r = http.post("/v1/chat/completions", json={"model": "fake-model", "messages": bad, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


@pytest.mark.parametrize(
    ("server", "extra", "param", "message"),
    [
        ("plain", {}, "tool_choice", '"auto" tool choice requires --enable-auto-tool-choice'),
        ("on", {"tool_choice": "sometimes"}, "tool_choice", "must be 'none', 'auto', 'required'"),
        (
            "on",
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        ("on", {"tool_choice": "required", "guided_regex": "a"}, "tool_choice", "both set"),
        (
            "plain",
            {
                "tool_choice": "required",
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            },
            "tools",
            "invalid JSON schema",
        ),
        ("on", {"tools": None, "tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
        # no tool can satisfy a forced call: 400, not an answer decoded under an empty schema
        ("on", {"tools": [], "tool_choice": "required"}, "tools", "tools must not be empty"),
        (
            "plain",
            {"tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tools",
            "tools must not be empty",
        ),
        ("on", {"tools": [{"type": "function"}]}, "tools", "tools[0]"),
        ("on", {"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools", "tools[0]"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_the_field(
    servers: dict, server: str, extra: dict[str, Any], param: str, message: str
) -> None:
    http, _ = servers[server]
    r = http.post("/v1/chat/completions", json=_chat(**extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"]


def test_tools_render_through_a_real_chat_template(tiny_model_dir: Any) -> None:
    """The engine hands ``tools`` (and a history's parsed tool calls) to the tokenizer's own
    ``apply_chat_template``: the prompt is exactly what transformers renders."""
    from lorastar import LLM

    template = (
        "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
        "{% endfor %}<assistant>"
    )
    llm = LLM(str(tiny_model_dir), num_kv_blocks=16, chat_template=template)
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": WEATHER}]},
        {"role": "tool", "content": "21"},
    ]
    tok = llm.engine.tokenizer
    want = tok(tok.apply_chat_template(messages, tools=TOOLS, tokenize=False), add_special_tokens=False)
    got = llm.engine.apply_chat_template(messages, tools=TOOLS)
    assert got == want["input_ids"]
    assert "get_weather" in tok.decode(got) and "Paris" in tok.decode(got)
    assert len(got) > len(llm.engine.apply_chat_template(messages))
    out = llm.chat(messages, tools=TOOLS)[0]
    assert out.prompt_token_ids == got


def test_the_openai_client_reads_the_calls(servers: dict) -> None:
    """The official client parses both shapes: a message's tool_calls, and streamed tool_call deltas
    (which it accumulates by index)."""
    import openai

    http, _ = servers["on"]
    client = openai.OpenAI(base_url=f"{str(http.base_url).rstrip('/')}/v1", api_key="x")
    body = _chat()
    kw = {k: body[k] for k in ("model", "messages", "max_tokens", "tools")}
    extra = {"add_generation_prompt": False}
    msg = client.chat.completions.create(**kw, extra_body=extra).choices[0].message
    assert msg.tool_calls[0].function.name == "get_weather" and msg.content == "Let me check."
    stream = client.chat.completions.create(**kw, extra_body=extra, stream=True)
    calls = [c for chunk in stream for ch in chunk.choices for c in ch.delta.tool_calls or []]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", WEATHER["arguments"])
    ]


def test_tokenize_renders_the_tools_as_chat_does(servers: dict) -> None:
    http, fake = servers["on"]
    r = http.post(
        "/tokenize",
        json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS},
    )
    assert r.status_code == 200, r.text
    assert fake.rendered[-1][1] == TOOLS


@pytest.mark.parametrize(
    ("server", "answer"),
    [
        ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'),
        (
            "qwen3_coder",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
        ),
    ],
)
def test_the_configured_parser_reads_the_answer(servers: dict, server: str, answer: str) -> None:
    """A server reads its parser's format (and leaves another's, hermes blocks here, as text); its
    tool requests are detokenized with the control tokens kept ([TOOL_CALLS] is one)."""
    http, fake = servers[server]
    body = {**_chat(), "messages": [{"role": "user", "content": answer[::-1]}], "max_tokens": len(answer)}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert fake.last_params.skip_special_tokens is False
    msg = http.post("/v1/chat/completions", json=_chat()).json()["choices"][0]["message"]
    assert msg["tool_calls"] == [] and msg["content"] == ANSWER
    http.post("/v1/chat/completions", json={**_chat(), "tools": None})  # no tools: text as usual
    assert fake.last_params.skip_special_tokens is True


REQUIRED_ANSWER = json.dumps(
    [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
)
TWO_TOOLS = [
    *TOOLS,
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"$ref": "#/$defs/Zone"}}, "$defs": {"Zone": {"enum": ["utc"]}}}}},
]  # fmt: skip


@pytest.mark.parametrize("server", ["plain", "on"])
def test_tool_choice_required_decodes_under_the_tools_schema(servers: dict, server: str) -> None:
    """``tool_choice: "required"`` needs no parser (vLLM's rule): the answer is decoded under a list-of-calls
    schema built from the tools (their $defs at the top) and read back as the calls; finish_reason tool_calls."""
    http, fake = servers[server]
    body = {**_chat(tool_choice="required", tools=TWO_TOOLS), "max_tokens": len(REQUIRED_ANSWER),
            "messages": [{"role": "user", "content": REQUIRED_ANSWER[::-1]}]}  # fmt: skip
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in choice["message"]["tool_calls"]
    ]
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    schema = json.loads(fake.last_params.guided_json)
    assert (
        schema["type"] == "array"
        and schema["minItems"] == 1
        and schema["$defs"] == {"Zone": {"enum": ["utc"]}}
    )
    names = [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]] and '"$defs":' not in json.dumps(schema["items"])
    assert fake.last_params.skip_special_tokens is True  # JSON: no control tokens to keep
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        frames = [
            json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"
        ]
    deltas = [ch["delta"] for f in frames for ch in f["choices"]]
    streamed = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for d in deltas
        for c in d.get("tool_calls", [])
    ]
    assert streamed == calls and not "".join(d.get("content", "") for d in deltas)
    assert frames[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_named_tool_choice_streams_its_arguments_as_they_come(servers: dict) -> None:
    """A named function: the answer, decoded under its parameters' schema, is its arguments; a stream
    sends them piece by piece under one call (id and name in the first piece), as vLLM does."""
    import openai

    http, fake = servers["plain"]
    args = '{"city": "Paris"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {
        **_chat(tool_choice=named),
        "max_tokens": len(args),
        "messages": [{"role": "user", "content": args[::-1]}],
    }
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("get_weather", args)
    # the engine's own reason (the fake always runs to max_tokens), not "tool_calls": vLLM's and OpenAI's rule
    assert choice["message"]["content"] is None and choice["finish_reason"] == "length"
    assert json.loads(fake.last_params.guided_json) == TOOLS[0]["function"]["parameters"]
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        frames = [
            json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"
        ]
    pieces = [c for f in frames for ch in f["choices"] for c in ch["delta"].get("tool_calls", [])]
    assert len(pieces) == len(args)  # one character a token here: the arguments come incrementally
    assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"].startswith("chatcmpl-tool-")
    assert all("id" not in p and "name" not in p["function"] and p["index"] == 0 for p in pieces[1:])
    assert "".join(p["function"]["arguments"] for p in pieces) == args
    client = openai.OpenAI(base_url=f"{str(http.base_url).rstrip('/')}/v1", api_key="x")
    kw = {k: body[k] for k in ("model", "messages", "max_tokens", "tools", "tool_choice")}
    stream = client.chat.completions.create(**kw, extra_body={"add_generation_prompt": False}, stream=True)
    got = [c for chunk in stream for ch in chunk.choices for c in ch.delta.tool_calls or []]
    assert got[0].function.name == "get_weather" and "".join(c.function.arguments for c in got) == args


def test_a_named_tool_choice_after_a_thinking_block_takes_the_rest_as_its_arguments(servers: dict) -> None:
    """With a reasoning parser, a named function's arguments are the answer after its thinking
    block, from their first character that is not whitespace (templates write "\\n\\n" after
    "</think>"): the block is reasoning, whole and streamed, and never part of the arguments."""
    http, _ = servers["on"]  # reasoning_parser="qwen3"
    args = '{"city": "Paris"}'
    answer = "<think>need weather</think>\n\n" + args
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {
        **_chat(tool_choice=named),
        "max_tokens": len(answer),
        "messages": [{"role": "user", "content": answer[::-1]}],
    }
    msg = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("need weather", None)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("get_weather", args)
    ]
    deltas = _stream_deltas(http, body)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "need weather"
    pieces = [c for d in deltas for c in d.get("tool_calls", [])]
    assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"].startswith("chatcmpl-tool-")
    assert (
        "".join(p["function"]["arguments"] for p in pieces) == args
        and pieces[0]["function"]["arguments"] == "{"
    )
    assert not "".join(d.get("content", "") for d in deltas)
    # cut inside the block: reasoning and a call without arguments, whole and streamed alike
    cut = {**body, "max_tokens": len("<think>need ")}
    msg = http.post("/v1/chat/completions", json=cut).json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "need " and msg["tool_calls"][0]["function"]["arguments"] == ""
    deltas = _stream_deltas(http, cut)
    pieces = [c for d in deltas for c in d.get("tool_calls", [])]
    assert len(pieces) == 1 and pieces[0]["function"] == {"name": "get_weather", "arguments": ""}


def test_structured_outputs_follow_the_reasoning_block(servers: dict) -> None:
    """With a reasoning parser, a constrained request names the thinking tags' ids, so the engine
    applies the constraint after the block (vLLM's behaviour); unconstrained requests do not, and
    a tokenizer whose tags are several tokens leaves the constraint from the first token."""
    from lorastar.plugin.routes.chat import reasoning_token_ids

    http, fake = servers["on"]  # reasoning_parser="qwen3"
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    inner = fake.tokenizer
    fake.tokenizer = TagTokenizer(inner)
    try:
        for extra in (
            {"guided_regex": "a+"},
            {"response_format": {"type": "json_object"}},
            {"tools": TOOLS, "tool_choice": "required"},
        ):
            assert http.post("/v1/chat/completions", json={**body, **extra}).status_code == 200
            p = fake.last_params
            assert (p.reasoning_start_token_id, p.reasoning_end_token_id) == (900, 901), extra
        http.post("/v1/chat/completions", json=body)
        assert fake.last_params.reasoning_end_token_id is None
        assert reasoning_token_ids(fake.tokenizer, "deepseek_r1") == (None, 901)
    finally:
        fake.tokenizer = inner
    assert reasoning_token_ids(inner, "qwen3") is None  # "<think>" is 7 tokens here
    http.post("/v1/chat/completions", json={**body, "guided_regex": "a+"})
    assert fake.last_params.reasoning_end_token_id is None


def test_a_thinking_token_budget_reaches_the_engine_with_the_tags(servers: dict) -> None:
    """vLLM's ``thinking_token_budget``: with the reasoning parser's tags as one token each, the
    engine gets the budget and the tags (it forces the end tag; tests/engine/test_thinking_budget.py);
    where it cannot be enforced, a 400 that says why."""
    http, fake = servers["on"]  # reasoning_parser="qwen3"
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    inner = fake.tokenizer
    fake.tokenizer = TagTokenizer(inner)
    try:
        assert http.post("/v1/chat/completions", json={**body, "thinking_token_budget": 5}).status_code == 200
        p = fake.last_params
        assert (p.thinking_token_budget, p.reasoning_start_token_id, p.reasoning_end_token_id) == (
            5,
            900,
            901,
        )
        bad = http.post("/v1/chat/completions", json={**body, "thinking_token_budget": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "thinking_token_budget"
    finally:
        fake.tokenizer = inner
    r = http.post("/v1/chat/completions", json={**body, "thinking_token_budget": 5})  # "<think>": 7 tokens
    assert r.status_code == 400 and "several tokens" in r.json()["error"]["message"]
    plain, _ = servers["plain"]
    r = plain.post("/v1/chat/completions", json={**body, "thinking_token_budget": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"
    assert "no reasoning parser" in r.json()["error"]["message"]


async def test_a_thinking_budget_message_is_encoded_once_and_sent_with_each_budget() -> None:
    """``thinking_budget_message`` is the server's: encoded at start (a startup error when it is
    longer than the engine takes), then the ids of every budgeted request's message."""
    from lorastar.plugin.service import LoraStarService

    fake = FakeAsyncLLM(max_model_len=1024)
    fake.tokenizer = TagTokenizer(fake.tokenizer)
    message = "\nTime is up.\n"
    cfg = LoraStarConfig(async_engine=fake, reasoning_parser="qwen3", thinking_budget_message=message)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(cfg)), base_url="http://t"
    ) as http:
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        r = await http.post("/v1/chat/completions", json={**body, "thinking_token_budget": 3})
        assert r.status_code == 200, r.text
        p = fake.last_params
        assert p.thinking_token_budget == 3 and p.thinking_budget_message_ids == [ord(c) for c in message]
        await http.post("/v1/chat/completions", json=body)
        assert fake.last_params.thinking_budget_message_ids is None  # no budget: no message
    too_long = LoraStarService(LoraStarConfig(async_engine=FakeAsyncLLM(), thinking_budget_message="x" * 65))
    with pytest.raises(ValueError, match="65 tokens"):
        await too_long.start()


def test_pythonic_answers_parse_as_calls_only_when_they_are_a_list_of_calls() -> None:
    text = '[get_weather(city="Paris", days=2, opts={"unit": "C"}), get_time()]'
    for answer in (text, f"<|python_start|>{text}<|python_end|>", f"  {text}\n"):
        assert _calls(answer, "pythonic") == (
            None, [("get_weather", {"city": "Paris", "days": 2, "opts": {"unit": "C"}}), ("get_time", {})]
        )  # fmt: skip
    for answer in (
        "The answer is [f(a=1)]",  # prose first: no call
        "[f(1)]",  # positional arguments
        "[f(a=b)]",  # not a literal
        "[f(**k)]",
        "[os.system(a='x')]",  # not a plain name
        "[]",
        "[f(a=1)] and more",
        "[" * 10_000 + "]" * 10_000,  # too deep to parse
        "[f(a=1e999)]",  # infinity is no JSON
    ):
        assert _calls(answer, "pythonic") == (answer, []), answer
