"""``/v1/messages`` in the combinations Anthropic's SDK clients send (tools with ``tool_choice``
options, thinking, stop sequences, streamed and whole), on a scripted fake engine with the hermes
tool parser and the qwen3 reasoning parser: the streamed message equals the whole one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from plugin_fake_engine import ScriptedLLM, say
from plugin_support import ServerThread
from test_messages import blocks_of

from lorastar.plugin import LoraStarConfig, create_app

anthropic = pytest.importorskip("anthropic")

TOOLS = [{"name": "get_weather", "description": "Weather now.", "input_schema": {"type": "object"}}]


def call(city: str) -> str:
    return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + city + '"}}\n</tool_call>'


class FlagLLM(ScriptedLLM):
    """The scripted engine, also keeping the template's prompt flags of the last render."""

    def apply_chat_template(self, messages: list[dict], *args: Any, **kw: Any) -> list[int]:
        self.flags = (
            args[0] if args else kw.get("add_generation_prompt", True),
            kw.get("continue_final_message"),
        )
        return super().apply_chat_template(messages, *args, **kw)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, FlagLLM]]:
    fake = FlagLLM(max_model_len=1024)
    cfg = LoraStarConfig(
        async_engine=fake, enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3"
    )
    with ServerThread(create_app(cfg)) as server:
        yield anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0), fake


@pytest.fixture
def client(served: tuple[Any, FlagLLM]) -> Any:
    return served[0]


def whole_and_streamed(client: Any, **kw: Any) -> tuple[Any, Any]:
    whole = client.messages.create(model="fake-model", **kw)
    with client.messages.stream(model="fake-model", **kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == len(final.content)
    assert blocks_of(final) == blocks_of(whole)
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert final.usage.output_tokens == whole.usage.output_tokens
    return whole, final


def test_disable_parallel_tool_use_keeps_the_first_call(client: Any) -> None:
    """Anthropic's ``tool_choice.disable_parallel_tool_use``: at most one tool_use block (the chat
    route's ``parallel_tool_calls: false``: the answer's first call)."""
    answer = "Checking." + call("Paris") + "\n" + call("Rome") + "§"
    kw = {"max_tokens": 500, "tools": TOOLS, "stop_sequences": ["§"],
          "messages": [{"role": "user", "content": say(answer)}]}  # fmt: skip
    both, _ = whole_and_streamed(client, **kw)
    assert [b[2] for b in blocks_of(both) if b[0] == "tool_use"] == [{"city": "Paris"}, {"city": "Rome"}]
    one = {"type": "auto", "disable_parallel_tool_use": True}
    whole, _ = whole_and_streamed(client, **kw, tool_choice=one)
    assert blocks_of(whole) == [("text", "Checking."), ("tool_use", "get_weather", {"city": "Paris"})]
    assert whole.stop_reason == "tool_use"
    # tool_choice any: the calls come as the tools' JSON list; one is kept likewise
    listed = json.dumps([{"name": "get_weather", "parameters": {"city": c}} for c in ("Paris", "Rome")])
    kw["messages"] = [{"role": "user", "content": say(listed + "§")}]
    whole, _ = whole_and_streamed(
        client, **kw, tool_choice={"type": "any", "disable_parallel_tool_use": True}
    )
    assert blocks_of(whole) == [("tool_use", "get_weather", {"city": "Paris"})]


def test_a_named_tool_cut_in_its_thinking_is_the_thinking_only(client: Any) -> None:
    """max_tokens reached before a forced call's input began: the thinking, no empty text block
    (whole) and no empty tool_use (streamed), stop_reason max_tokens either way."""
    answer = '<think>hmm hmm</think>{"city": "Paris"}'
    kw = {"max_tokens": len("<think>h"), "tools": TOOLS,
          "tool_choice": {"type": "tool", "name": "get_weather"},
          "messages": [{"role": "user", "content": say(answer)}]}  # fmt: skip
    whole, _ = whole_and_streamed(client, **kw)
    assert blocks_of(whole) == [("thinking", "h")] and whole.stop_reason == "max_tokens"
    # the whole answer: the thinking, then the call
    whole, _ = whole_and_streamed(client, **{**kw, "max_tokens": len(answer)})
    assert blocks_of(whole) == [("thinking", "hmm hmm"), ("tool_use", "get_weather", {"city": "Paris"})]


@pytest.mark.parametrize(
    "system", ["", [], [{"type": "text", "text": "", "cache_control": {"type": "ephemeral"}}]]
)
def test_an_empty_system_is_no_system_message(served: tuple[Any, FlagLLM], system: Any) -> None:
    """An empty ``system`` (a string or blocks) renders as none at all, as vLLM's route drops it:
    the template keeps its default system prompt (SmolLM2's, Qwen's) as it would without one."""
    client, fake = served
    kw = {"model": "fake-model", "max_tokens": 1, "messages": [{"role": "user", "content": "ab"}]}
    client.messages.create(**kw, system=system)
    assert fake.rendered[-1][0] == [{"role": "user", "content": "ab"}]
    client.messages.count_tokens(model="fake-model", messages=kw["messages"], system=system)
    assert fake.rendered[-1][0] == [{"role": "user", "content": "ab"}]
    # text blocks with cache_control are read as their text
    blocks = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    client.messages.create(**kw, system=blocks)
    assert fake.rendered[-1][0][0] == {"role": "system", "content": "Be brief."}


def test_a_last_assistant_turn_is_a_prefill_the_answer_continues(served: tuple[Any, FlagLLM]) -> None:
    """Anthropic's prefill: a last assistant turn of text is continued (the template's
    continue_final_message, no new assistant turn), counted alike; otherwise a new turn."""
    client, fake = served
    prefill = [{"role": "user", "content": "Colours?"}, {"role": "assistant", "content": "Red, "}]
    kw = {"model": "fake-model", "max_tokens": 1, "messages": prefill}
    client.messages.create(**kw)
    assert fake.flags == (False, True) and fake.rendered[-1][0][-1] == prefill[-1]
    with client.messages.stream(**kw) as stream:
        stream.get_final_message()
    assert fake.flags == (False, True)
    client.messages.count_tokens(model="fake-model", messages=prefill)
    assert fake.flags == (False, True)
    blocks = [{"role": "assistant", "content": [{"type": "text", "text": "Red, "}]}]
    client.messages.create(**{**kw, "messages": prefill[:1] + blocks})
    assert fake.flags == (False, True)
    # a user turn last: a new assistant turn
    client.messages.create(**{**kw, "messages": prefill[:1]})
    assert fake.flags == (True, False)
