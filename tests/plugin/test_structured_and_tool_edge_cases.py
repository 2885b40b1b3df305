"""Structured outputs and tool calling edge cases (model output that parses into text no
UTF-8 response can carry, or nests deeper than Python's recursion limit)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from plugin_fake_engine import ScriptedLLM, say
from plugin_support import ServerThread

from lorastar.plugin import LoraStarConfig, create_app
from lorastar.plugin.tool_parsers import REQUIRED, parse_tool_calls

DEEP = "[" * 1500 + "]" * 1500  # deeper than Python's recursion limit (1000)
# Each parser's answer with a lone-surrogate escape in an argument (as a model may write "\ud800"),
# and one with an argument nested DEEP.
SURROGATE_ANSWERS = {
    "hermes": '<tool_call>{"name": "f", "arguments": {"x": "\\ud800é"}}</tool_call>',
    "llama3_json": '{"name": "f", "parameters": {"x": "\\ud800é"}}',
    "mistral": '[TOOL_CALLS]f[ARGS]{"x": "\\ud800é"}',
    "pythonic": '[f(x="\\ud800é")]',
    "qwen3_coder": '<tool_call><function=f><parameter=x>{"y": "\\ud800é"}</parameter></function></tool_call>',
    REQUIRED: '[{"name": "f", "parameters": {"x": "\\ud800é"}}]',
}
DEEP_ANSWERS = {
    "hermes": '<tool_call>{"name": "f", "arguments": {"x": ' + DEEP + "}}</tool_call>",
    "llama3_json": '{"name": "f", "parameters": {"x": ' + DEEP + "}}",
    "mistral": '[TOOL_CALLS]f[ARGS]{"x": ' + DEEP + "}",
    REQUIRED: '[{"name": "f", "parameters": {"x": ' + DEEP + "}}]",
}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "object"}}}}}]  # fmt: skip


@pytest.mark.parametrize("parser", list(SURROGATE_ANSWERS))
def test_lone_surrogate_escapes_in_arguments_give_utf8_json(parser: str) -> None:
    """A lone surrogate the model wrote as an escape stays an escape in the arguments: JSON text that
    encodes as UTF-8 (a raw surrogate failed the response's encoding: a 500) and means the same."""
    content, [call] = parse_tool_calls(SURROGATE_ANSWERS[parser], parser, TOOLS)
    assert content is None and call.name == "f"
    call.arguments.encode("utf-8")  # raised UnicodeEncodeError
    args = json.loads(call.arguments)
    assert args == {"x": {"y": "\ud800é"}} if parser == "qwen3_coder" else args == {"x": "\ud800é"}


def test_a_name_no_response_can_carry_is_no_call() -> None:
    text = '<tool_call>{"name": "f\\udc00", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, "hermes") == (text, [])


@pytest.mark.parametrize("parser", list(DEEP_ANSWERS))
def test_json_nested_past_the_recursion_limit_stays_content(parser: str) -> None:
    """A degenerate answer nesting thousands deep is no call: it stays content (RecursionError
    escaped the parser: a 400 "request body nested too deeply" for a valid request)."""
    text = DEEP_ANSWERS[parser]
    assert parse_tool_calls(text, parser, TOOLS) == (text, [])


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, tuple[httpx.Client, ScriptedLLM]]]:
    fakes = {p: ScriptedLLM(max_model_len=8192, step_delay=0) for p in ("hermes", "mistral")}
    with (
        ServerThread(create_app(LoraStarConfig(
            async_engine=fakes["hermes"], enable_auto_tool_choice=True, tool_call_parser="hermes"))) as a,
        ServerThread(create_app(LoraStarConfig(
            async_engine=fakes["mistral"], enable_auto_tool_choice=True, tool_call_parser="mistral"))) as b,
        httpx.Client(base_url=a.url, timeout=60) as ca,
        httpx.Client(base_url=b.url, timeout=60) as cb,
    ):  # fmt: skip
        yield {"hermes": (ca, fakes["hermes"]), "mistral": (cb, fakes["mistral"])}


def _chat(http: httpx.Client, answer: str, stream: bool, **extra: Any) -> tuple[int, list[dict[str, Any]]]:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": say(answer)}],
            "max_tokens": len(answer), "tools": TOOLS, "stream": stream, **extra}  # fmt: skip
    r = http.post("/v1/chat/completions", json=body)
    if not stream:
        return r.status_code, [r.json()]
    return r.status_code, [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]


@pytest.mark.parametrize(
    ("server", "answer", "extra"),
    [
        ("hermes", SURROGATE_ANSWERS["hermes"], {}),
        ("mistral", SURROGATE_ANSWERS["mistral"], {}),
        ("hermes", SURROGATE_ANSWERS[REQUIRED], {"tool_choice": "required"}),
    ],
)
def test_surrogate_arguments_over_http_are_calls_not_500s(
    servers: dict, server: str, answer: str, extra: dict[str, Any]
) -> None:
    http, _ = servers[server]
    status, [body] = _chat(http, answer, False, **extra)
    assert status == 200, body
    [call] = body["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"x": "\ud800é"}
    status, frames = _chat(http, answer, True, **extra)
    assert status == 200 and not any("error" in f for f in frames), frames[-1]
    streamed = [c for f in frames for ch in f["choices"] for c in ch["delta"].get("tool_calls", [])]
    assert [json.loads(c["function"]["arguments"]) for c in streamed] == [{"x": "\ud800é"}]


@pytest.mark.parametrize("stream", [False, True])
def test_surrogate_arguments_in_anthropic_messages_are_no_500(servers: dict, stream: bool) -> None:
    """/v1/messages decodes a call's arguments into ``tool_use.input``: a lone surrogate escape
    decoded is text no UTF-8 response carries, so the call stays text (as written, escape and all)."""
    http, _ = servers["hermes"]
    answer = SURROGATE_ANSWERS["hermes"]
    body = {"model": "fake-model", "max_tokens": len(answer), "stream": stream,
            "messages": [{"role": "user", "content": say(answer)}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}]}  # fmt: skip
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        blocks = r.json()["content"]
        assert [b["type"] for b in blocks] == ["text"] and "\\ud800" in blocks[0]["text"]
    else:
        assert "event: error" not in r.text and "event: message_stop" in r.text


@pytest.mark.parametrize("stream", [False, True])
def test_deeply_nested_answer_over_http_is_content(servers: dict, stream: bool) -> None:
    http, _ = servers["hermes"]
    answer = DEEP_ANSWERS["hermes"]
    status, frames = _chat(http, answer, stream)
    assert status == 200 and not any("error" in f for f in frames), frames[-1]
    if stream:
        text = "".join(ch["delta"].get("content") or "" for f in frames for ch in f["choices"])
        assert not any(ch["delta"].get("tool_calls") for f in frames for ch in f["choices"])
    else:
        msg = frames[0]["choices"][0]["message"]
        text, calls = msg["content"], msg["tool_calls"]
        assert calls == []
    assert text == answer


@pytest.mark.parametrize(
    ("route", "body", "constraint", "param"),
    [
        ("/v1/completions", {"prompt": "Hi"}, {"guided_json": {"$ref": "#"}}, "guided_json"),
        ("/v1/completions", {"prompt": "Hi"}, {"guided_grammar": "root ::= root"}, "guided_grammar"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]},
         {"structured_outputs": {"json": {"anyOf": [{"$ref": "#"}]}}}, "guided_json"),
    ],
)  # fmt: skip
def test_a_constraint_that_accepts_no_output_is_a_400(
    real_server: ServerThread, route: str, body: dict[str, Any], constraint: dict[str, Any], param: str
) -> None:
    """A schema or grammar whose language is empty masked every token: the sampler took token 0 and
    the answer came back "stop" with text the constraint refuses (an empty JSON "value"). A 400
    naming the field instead, and the engine serves on."""
    from plugin_support import engine_idle, wait_until

    url = real_server.url + route
    for stream in (False, True):
        r = httpx.post(url, json={"model": "tiny", "max_tokens": 8, "stream": stream, **body, **constraint})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "accepts no output" in err["message"], err
    ok = httpx.post(url, json={"model": "tiny", "max_tokens": 8, "temperature": 0, **body,
                               "guided_grammar": 'root ::= "yes" | "no"'})  # fmt: skip
    assert ok.status_code == 200, ok.text
    got = ok.json()["choices"][0]
    assert (got.get("text") or got.get("message", {}).get("content")) in ("yes", "no")
    assert wait_until(lambda: engine_idle(real_server.plugin.engine), timeout=10)


def test_a_grammar_that_dead_ends_later_ends_on_eos_without_a_junk_token(real_server: ServerThread) -> None:
    """A grammar that allows a start and then no token at all (``x ::= x``): the row ends on EOS
    there. Left to the sampler, every logit was -inf and the argmax took token 0 into the answer
    (SmolLM2's <|endoftext|> here; Llama 3's "!", visible text)."""
    from plugin_support import engine_idle, wait_until

    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 8, "temperature": 0, "logprobs": 0,
            "skip_special_tokens": False, "guided_grammar": 'root ::= "ab" x\nx ::= x'}  # fmt: skip
    for stream in (False, True):
        r = httpx.post(real_server.url + "/v1/completions", json={**body, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            frames = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
            choices = [c for f in frames for c in f["choices"]]
            text = "".join(c["text"] for c in choices)
            tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
            finish = choices[-1]["finish_reason"]
        else:
            choice = r.json()["choices"][0]
            text, tokens, finish = choice["text"], choice["logprobs"]["tokens"], choice["finish_reason"]
        assert (text, finish) == ("ab", "stop"), (text, tokens)
        assert "<|endoftext|>" not in tokens, tokens
    assert wait_until(lambda: engine_idle(real_server.plugin.engine), timeout=10)
