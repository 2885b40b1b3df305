"""Tool-call parsers against vLLM's own (hermes, llama3_json, mistral, qwen3_coder, pythonic and
``tool_choice: "required"``) on what real fine-tunes write: several calls, text around them, nested
and escaped arguments, arguments as text, Mistral's v11 call ids, Qwen3-Coder's nullable types; a
stream split at every character gives the whole answer's calls; the chat route's ``content`` and
``finish_reason`` (fake engine: ``ScriptedLLM`` answers what ``say`` wrote, a character a token)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from plugin_fake_engine import ScriptedLLM, say
from plugin_support import ServerThread

from lorastar.plugin import LoraStarConfig, create_app
from lorastar.plugin.tool_parsers import REQUIRED, ToolCallStream, parse_tool_calls

TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "opt": {"type": ["integer", "null"]}, "label": {"type": ["string", "null"]},
        "on": {"type": ["boolean", "null"]}, "obj": {"type": ["object", "null"]}, "text": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}},
]  # fmt: skip

Calls = list[tuple[str, Any]]


def _read(text: str, parser: str) -> tuple[str | None, Calls]:
    content, calls = parse_tool_calls(text, parser, TOOLS)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed(deltas: list[str], parser: str) -> tuple[str, Calls]:
    stream = ToolCallStream(parser, TOOLS)
    content, calls = "", []
    for i, d in enumerate(deltas):
        c, got = stream.feed(d, final=i == len(deltas) - 1)
        content += c
        calls += got
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def _check_every_split(text: str, parser: str, want: tuple[str | None, Calls]) -> None:
    """The whole answer reads as ``want``; so does its stream, cut anywhere or a character a delta."""
    assert _read(text, parser) == want
    for cut in range(len(text) + 1):
        assert _streamed([text[:cut], text[cut:]], parser) == (want[0] or "", want[1]), cut
    assert _streamed(list(text), parser) == (want[0] or "", want[1])


# vLLM's reading of each answer, (content, [(name, arguments)]), where lorastar keeps it; it differs
# on purpose where noted (arguments already JSON text pass as written; vLLM encodes them again).
FIDELITY: list[tuple[str, str, tuple[str | None, Calls]]] = [
    # hermes: text before the first call is the content, text after the calls is dropped
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"text": "say \\"hi\\" {x} [y] é 😀", '
     '"deep": {"a": [1, {"b": null}]}}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\nDone.',
     ("Let me check.\n", [("f", {"text": 'say "hi" {x} [y] é 😀', "deep": {"a": [1, {"b": None}]}}), ("g", {})])),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"text": "<tool_call> inside"}}</tool_call>',
     (None, [("f", {"text": "<tool_call> inside"})])),
    ("hermes", '<tool_call>{"name": "nowhere", "arguments": {"a": 1}}</tool_call>', (None, [("nowhere", {"a": 1})])),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"n\\": 1}"}</tool_call>', (None, [("f", {"n": 1})])),  # (noted above)
    ("hermes", 'Hm <tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',  # invalid JSON: all content
     ('Hm <tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', [])),
    ("hermes", "a < b and <tool_ but no call", ("a < b and <tool_ but no call", [])),
    # llama3_json: parameters or arguments, calls separated by ";", after an optional <|python_tag|>
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"text": "a; b} {c"}}; {"name": "g", "arguments": {"u": "ü"}}',
     (None, [("f", {"text": "a; b} {c"}), ("g", {"u": "ü"})])),
    # mistral: the JSON list before v11, name[ARGS]{...} per call from v11
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "f", "arguments": {"text": "[TOOL"}}, {"name": "g", "arguments": {}}]',
     ("Sure.", [("f", {"text": "[TOOL"}), ("g", {})])),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"deep": {"a": ["}", "{"]}}[TOOL_CALLS]g[ARGS]{}',
     (None, [("f", {"deep": {"a": ["}", "{"]}}), ("g", {})])),
    ("mistral", "[TOOL_CALLS]f[ARGS]{cut", ("[TOOL_CALLS]f[ARGS]{cut", [])),
    # pythonic: keyword arguments of every literal type (vLLM refuses negative numbers; they parse here)
    ("pythonic", "[f(s='it\\'s', d=\"q\\\"]\", i=3, x=1.5, t=True, no=None, l=[1, 'a'], m={'k': {'z': [False]}}, neg=-2), g()]",
     (None, [("f", {"s": "it's", "d": 'q"]', "i": 3, "x": 1.5, "t": True, "no": None, "l": [1, "a"],
                    "m": {"k": {"z": [False]}}, "neg": -2}), ("g", {})])),
    ("pythonic", "[f(a=1), print]", ("[f(a=1), print]", [])),
    # qwen3_coder: values typed by the tool's schema
    ("qwen3_coder", "On it.\n<tool_call>\n<function=f>\n<parameter=n>\n4\n</parameter>\n<parameter=text>\n"
     "<b>1 < 2</b>\n</parameter>\n</function>\n</tool_call>",
     ("On it.\n", [("f", {"n": 4, "text": "<b>1 < 2</b>"})])),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "want"), FIDELITY)
def test_answers_read_as_vllm_reads_them_whole_and_streamed(
    parser: str, text: str, want: tuple[str | None, Calls]
) -> None:
    _check_every_split(text, parser, want)


TEXT_ARGUMENTS = {
    "hermes": '<tool_call>{"name": "f", "arguments": "Paris"}</tool_call>',
    "llama3_json": '{"name": "f", "arguments": "Paris"}',
    "mistral": '[TOOL_CALLS][{"name": "f", "arguments": "Paris"}]',
    REQUIRED: '[{"name": "f", "parameters": "Paris"}]',
}


@pytest.mark.parametrize("parser", list(TEXT_ARGUMENTS))
def test_arguments_written_as_text_become_a_json_string(parser: str) -> None:
    """vLLM writes a call's arguments with json.dumps: text that is no JSON becomes a JSON string
    (it went out as it was, ``Paris``: no client could parse it). JSON text passes as written."""
    _check_every_split(TEXT_ARGUMENTS[parser], parser, (None, [("f", "Paris")]))
    empty = TEXT_ARGUMENTS[parser].replace('"Paris"', '""')
    assert parse_tool_calls(empty, parser)[1][0].arguments == '""'
    as_json = TEXT_ARGUMENTS[parser].replace('"Paris"', '"{\\"n\\": 1}"')
    assert parse_tool_calls(as_json, parser)[1][0].arguments == '{"n": 1}'


def test_mistral_v11_call_ids_stay_out_of_the_name() -> None:
    """Mistral's v11 templates write ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}``; the function is
    ``name`` (it was ``name[CALL_ID]id``, a function no client has)."""
    text = 'Ok.[TOOL_CALLS]f[CALL_ID]a1B2c3D4e[ARGS]{"n": 1}[TOOL_CALLS]g[CALL_ID]Zz9Yy8Xx7[ARGS]{}'
    _check_every_split(text, "mistral", ("Ok.", [("f", {"n": 1}), ("g", {})]))


def test_qwen3_coder_types_nullable_union_types_by_their_other_type() -> None:
    """OpenAI's strict schemas make a parameter optional with ``"type": ["integer", "null"]``: the
    value is typed as an integer (vLLM's fallback reads it as a Python literal); it was text."""
    text = (
        "<tool_call>\n<function=f>\n<parameter=opt>\n5\n</parameter>\n<parameter=label>\n123\n</parameter>\n"
        '<parameter=on>\ntrue\n</parameter>\n<parameter=obj>\n{"a": [1]}\n</parameter>\n</function>\n</tool_call>'
    )
    _check_every_split(
        text, "qwen3_coder", (None, [("f", {"opt": 5, "label": "123", "on": True, "obj": {"a": [1]}})])
    )
    nulls = text.replace("\n5\n", "\nnull\n").replace("\n123\n", "\nnull\n")
    assert (
        _read(nulls, "qwen3_coder")[1][0][1]["opt"] is None
        and _read(nulls, "qwen3_coder")[1][0][1]["label"] is None
    )


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    config = LoraStarConfig(
        async_engine=ScriptedLLM(max_model_len=8192, step_delay=0),
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    with ServerThread(create_app(config)) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def _body(answer: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": say(answer)}],
        "max_tokens": len(answer),
        "tools": TOOLS,
        **extra,
    }


def _stream(http: httpx.Client, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]], str | None]:
    r = http.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    frames = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    choices = [c for f in frames for c in f["choices"]]
    content = "".join(c["delta"].get("content") or "" for c in choices)
    calls = [t for c in choices for t in c["delta"].get("tool_calls", [])]
    return content, calls, next((c["finish_reason"] for c in choices if c["finish_reason"]), None)


@pytest.mark.parametrize(
    ("answer", "content", "calls"),
    [
        ('Checking.<tool_call>{"name": "nowhere", "arguments": {"a": "é"}}</tool_call> bye',
         "Checking.", [("nowhere", {"a": "é"})]),
        ('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',
         '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', []),
    ],
)  # fmt: skip
def test_the_route_gives_vllms_content_and_finish_reason(
    http: httpx.Client, answer: str, content: str, calls: Calls
) -> None:
    """Calls (even to a function not in ``tools``, as vLLM): ``finish_reason`` "tool_calls", the text
    before them the content; no call (JSON that does not parse): all the text, "stop"/"length"."""
    choice = http.post("/v1/chat/completions", json=_body(answer)).json()["choices"][0]
    got = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in choice["message"]["tool_calls"]
    ]
    assert (choice["message"]["content"], got) == (content, calls)
    assert choice["finish_reason"] == ("tool_calls" if calls else "length")
    s_content, s_calls, finish = _stream(http, _body(answer))
    assert s_content == content and finish == choice["finish_reason"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in s_calls] == calls


def test_a_call_with_text_arguments_can_be_sent_back_in_the_history(http: httpx.Client) -> None:
    """The assistant message as the server returned it goes back in the next request: its
    arguments must be JSON (they were ``Paris``: the next request was a 400)."""
    body = _body(TEXT_ARGUMENTS["hermes"])
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    _, [streamed], _ = _stream(http, body)
    assert message["tool_calls"][0]["function"]["arguments"] == streamed["function"]["arguments"] == '"Paris"'
    history = [
        *body["messages"],
        {"role": "assistant", "content": None, "tool_calls": message["tool_calls"]},
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "sunny"},
        {"role": "user", "content": "x"},
    ]
    r = http.post("/v1/chat/completions", json={**body, "messages": history, "max_tokens": 1})
    assert r.status_code == 200, r.text
