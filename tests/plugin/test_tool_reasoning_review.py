"""Tool calling and reasoning on the chat route against vLLM's OpenAI server: ``parallel_tool_calls``,
malformed ``tool_choice``, the ids of ``tool_choice: "required"`` calls on a Mistral server, and
logprobs with the reasoning hidden (fake engine: ``ScriptedLLM`` answers what ``say`` wrote)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from plugin_fake_engine import ScriptedLLM, say
from plugin_support import ServerThread

from lorastar.plugin import LoraStarConfig, create_app

TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}},
]


def _block(name: str, args: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


TWO_CALLS = "Checking." + _block("f", {"a": 1}) + "\n" + _block("g", {})
REQUIRED_TWO = json.dumps([{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}])


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, httpx.Client]]:
    hermes = LoraStarConfig(
        async_engine=ScriptedLLM(max_model_len=4096, step_delay=0),
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
    )
    mistral = LoraStarConfig(
        async_engine=ScriptedLLM(max_model_len=4096, step_delay=0),
        enable_auto_tool_choice=True,
        tool_call_parser="mistral",
    )
    with (
        ServerThread(create_app(hermes)) as a,
        ServerThread(create_app(mistral)) as b,
        httpx.Client(base_url=a.url, timeout=30) as ca,
        httpx.Client(base_url=b.url, timeout=30) as cb,
    ):
        yield {"hermes": ca, "mistral": cb}


def _body(answer: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": say(answer)}],
        "max_tokens": len(answer),
        "tools": TOOLS,
        **extra,
    }


def _frames(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = http.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    return [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]


def _streamed_calls(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for f in frames for ch in f["choices"] for c in ch["delta"].get("tool_calls", [])]


@pytest.mark.parametrize(
    ("answer", "extra"),
    [(TWO_CALLS, {}), (REQUIRED_TWO, {"tool_choice": "required"})],
)
def test_parallel_tool_calls_false_returns_only_the_first_call(
    servers: dict[str, httpx.Client], answer: str, extra: dict[str, Any]
) -> None:
    """vLLM's ``maybe_filter_parallel_tool_calls``: ``parallel_tool_calls: false`` keeps the first
    call (whole answers) and the index-0 call (streamed deltas); unset or true keeps them all. It
    was ignored: both calls came back."""
    http = servers["hermes"]
    for flag, want in ((None, ["f", "g"]), (True, ["f", "g"]), (False, ["f"])):
        body = _body(answer, **extra, **({} if flag is None else {"parallel_tool_calls": flag}))
        choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == want, flag
        assert choice["finish_reason"] == "tool_calls"
        frames = _frames(http, body)
        calls = _streamed_calls(frames)
        assert [(c["index"], c["function"]["name"]) for c in calls] == list(enumerate(want)), flag
        assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
        assert frames[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("function", ["f", None, ["f"], 3])
def test_a_named_tool_choice_whose_function_is_no_object_is_a_400(
    servers: dict[str, httpx.Client], function: Any
) -> None:
    """``tool_choice: {"type": "function", "function": "f"}`` was a 500 (``str.get``): a 400 naming
    ``tool_choice`` (vLLM's request validation refuses it too)."""
    r = servers["hermes"].post(
        "/v1/chat/completions", json=_body("x", tool_choice={"type": "function", "function": function})
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tool_choice"


def test_required_calls_on_a_mistral_server_take_mistral_ids(servers: dict[str, httpx.Client]) -> None:
    """A Mistral server's calls carry 9-character ids (its templates refuse others when the call
    comes back in the history, as the ``mistral`` parser and a named function already do); those of
    ``tool_choice: "required"`` were OpenAI's ``chatcmpl-tool-...``."""
    http = servers["mistral"]
    body = _body(REQUIRED_TWO, tool_choice="required")
    calls = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["tool_calls"]
    ids = [c["id"] for c in calls] + [c["id"] for c in _streamed_calls(_frames(http, body))]
    assert len(ids) == 4 and all(len(i) == 9 and i.isalnum() for i in ids), ids
    named = {"type": "function", "function": {"name": "f"}}
    [call] = http.post("/v1/chat/completions", json=_body("{}", tool_choice=named)).json()["choices"][0][
        "message"
    ]["tool_calls"]
    assert len(call["id"]) == 9 and call["id"].isalnum()
    # the hermes server keeps OpenAI's form
    calls = servers["hermes"].post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls["tool_calls"])


def test_hidden_reasoning_hides_the_logprobs_too(servers: dict[str, httpx.Client]) -> None:
    """vLLM: with ``include_reasoning: false`` (and a reasoning parser) logprobs are left out, whole
    and streamed, since their tokens spell the hidden reasoning out. They carried every thinking
    token ("s", "e", "c", ...), and the stream sent a chunk per hidden token."""
    http = servers["hermes"]
    answer = "<think>secret</think>ok"
    body = _body(answer, logprobs=True, tools=None)
    shown = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert "".join(t["token"] for t in shown["logprobs"]["content"]) == answer
    hidden = http.post("/v1/chat/completions", json={**body, "include_reasoning": False}).json()
    choice = hidden["choices"][0]
    assert choice["message"]["content"] == "ok" and choice["message"]["reasoning_content"] is None
    assert choice["logprobs"] is None
    frames = _frames(http, {**body, "include_reasoning": False})
    choices = [ch for f in frames for ch in f["choices"]]
    assert all(ch["logprobs"] is None for ch in choices)
    assert not any("secret" in json.dumps(f) for f in frames)
    assert "".join(ch["delta"].get("content", "") for ch in choices) == "ok"


def test_the_openai_client_reads_answers_with_tools_as_vllms(servers: dict[str, httpx.Client]) -> None:
    """What the official client parses, as vLLM answers: a plain answer with tools present (no
    calls, the engine's finish_reason), text then parallel calls (content apart, calls by index,
    finish_reason tool_calls), a malformed call (all of it content), reasoning before a call."""
    import openai

    http = servers["hermes"]
    client = openai.OpenAI(base_url=f"{str(http.base_url).rstrip('/')}/v1", api_key="x")

    def ask(answer: str, stream: bool, **kw: Any) -> tuple[Any, Any, str | None, list[Any], str | None]:
        body = _body(answer, **kw)
        args = {k: body.pop(k) for k in ("model", "messages", "max_tokens", "tools")}
        if not stream:
            choice = client.chat.completions.create(**args, extra_body=body).choices[0]
            m = choice.message
            calls = [(c.id, c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
            return m.content, getattr(m, "reasoning_content", None), None, calls, choice.finish_reason
        content, reasoning, finish, calls = "", "", None, []
        for chunk in client.chat.completions.create(**args, extra_body=body, stream=True):
            for ch in chunk.choices:
                content += ch.delta.content or ""
                reasoning += getattr(ch.delta, "reasoning_content", None) or ""
                calls += [
                    (c.index, c.id, c.function.name, json.loads(c.function.arguments))
                    for c in ch.delta.tool_calls or []
                ]
                finish = ch.finish_reason or finish
        return content or None, reasoning or None, None, calls, finish

    for stream in (False, True):
        content, _, _, calls, finish = ask("Just text.", stream)
        assert (content, calls, finish) == ("Just text.", [], "length")
        content, _, _, calls, finish = ask(TWO_CALLS, stream)
        assert content == "Checking." and finish == "tool_calls"
        assert [c[-2:] for c in calls] == [("f", {"a": 1}), ("g", {})]
        assert all(c[-3].startswith("chatcmpl-tool-") for c in calls) and calls[0][-3] != calls[1][-3]
        if stream:
            assert [c[0] for c in calls] == [0, 1]
        broken = "Sure <tool_call>{not json</tool_call>"
        content, _, _, calls, finish = ask(broken, stream)
        assert (content, calls, finish) == (broken, [], "length")
        content, reasoning, _, calls, _ = ask("<think>plan</think>" + _block("f", {}), stream)
        assert (content, reasoning, [c[-2:] for c in calls]) == (None, "plan", [("f", {})])
