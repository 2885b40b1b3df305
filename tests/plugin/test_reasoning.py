"""Reasoning parsers (``LoraStarConfig.reasoning_parser``, vLLM's ``--reasoning-parser``): the
splitter's answers per style, streams that split any way give the whole answer's split, and the chat
route over HTTP (fake engine: it answers with its prompt reversed, one character a token)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plugin_fake_engine import FakeAsyncLLM
from plugin_support import ServerThread

from lorastar.plugin import LoraStarConfig, create_app
from lorastar.plugin.reasoning import ReasoningSplitter


@pytest.mark.parametrize(
    ("style", "text", "want"),
    [
        ("qwen3", "<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "\n\nanswer")),
        ("qwen3", "answer only", (None, "answer only")),  # enable_thinking=False: no block generated
        ("qwen3", "\n<think>a</think>", ("a", None)),  # leading whitespace, nothing after the block
        ("qwen3", "<think>cut off by max_tokens", ("cut off by max_tokens", None)),
        ("qwen3", "the <think> tag later is content", (None, "the <think> tag later is content")),
        ("qwen3", "<thin", (None, "<thin")),  # never became the tag
        ("deepseek_r1", "plan</think>answer", ("plan", "answer")),  # the prompt opened the block
        ("deepseek_r1", "<think>plan</think>answer", ("plan", "answer")),
        ("deepseek_r1", "all reasoning, no end", ("all reasoning, no end", None)),
        ("deepseek_r1", "</think>", ("", None)),
    ],
)
def test_whole_answers_split_as_vllm_splits_them(style: str, text: str, want: tuple[Any, Any]) -> None:
    assert ReasoningSplitter(style).split(text) == want


_PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a", "b c", "\n", "</thi", "nk>"])


@settings(max_examples=300, deadline=None)
@given(
    style=st.sampled_from(["qwen3", "deepseek_r1"]),
    pieces=st.lists(_PIECES, max_size=12),
    cuts=st.lists(st.integers(0, 60), max_size=8),
)
def test_a_stream_split_anywhere_gives_the_whole_answers_split(
    style: str, pieces: list[str], cuts: list[int]
) -> None:
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    splitter = ReasoningSplitter(style)
    reasoning, content = "", ""
    for i, d in enumerate(deltas):
        r, c = splitter.feed(d, final=i == len(deltas) - 1)
        reasoning, content = reasoning + r, content + c
    whole_r, whole_c = ReasoningSplitter(style).split(text)
    assert (reasoning, content) == (whole_r or "", whole_c or "")
    assert splitter.buf == ""  # nothing held back after the last delta


def test_an_unknown_parser_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="reasoning_parser"):
        LoraStarConfig(reasoning_parser="r1")


ANSWER = "<think>two steps</think>\n\nforty-two"


@pytest.fixture(scope="module")
def fake() -> FakeAsyncLLM:
    return FakeAsyncLLM()


@pytest.fixture(scope="module")
def http(fake: FakeAsyncLLM) -> Iterator[httpx.Client]:
    app = create_app(LoraStarConfig(async_engine=fake, reasoning_parser="qwen3"))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


def _chat(**extra: Any) -> dict[str, Any]:
    # The fake answers with the rendered prompt ("<user>" + content) reversed: exactly ANSWER here.
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": ANSWER[::-1]}],
        "add_generation_prompt": False,
        "max_tokens": len(ANSWER),
        **extra,
    }


def test_chat_answers_carry_the_reasoning_apart(http: httpx.Client) -> None:
    msg = http.post("/v1/chat/completions", json=_chat()).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("two steps", "\n\nforty-two")
    assert msg["reasoning"] == "two steps"  # newer vLLM's name for the same text
    dropped = http.post("/v1/chat/completions", json=_chat(include_reasoning=False)).json()
    assert dropped["choices"][0]["message"]["reasoning_content"] is None
    assert dropped["choices"][0]["message"]["reasoning"] is None
    assert dropped["choices"][0]["message"]["content"] == "\n\nforty-two"


@pytest.mark.parametrize("include_reasoning", [True, False])
def test_streamed_chat_sends_reasoning_then_content_deltas(
    http: httpx.Client, include_reasoning: bool
) -> None:
    reasoning, content, frames = "", "", []
    with http.stream(
        "POST", "/v1/chat/completions", json=_chat(stream=True, include_reasoning=include_reasoning)
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                frames.append(json.loads(line[6:]))
    for f in frames:
        for ch in f["choices"]:
            delta = ch["delta"]
            assert "<" not in delta.get("reasoning_content", "") + delta.get("content", "")  # no tag leaks
            reasoning += delta.get("reasoning_content", "")
            assert delta.get("reasoning") == delta.get("reasoning_content")  # both names, one text
            content += delta.get("content", "")
    assert reasoning == ("two steps" if include_reasoning else "")
    assert content == "\n\nforty-two"
    assert frames[-1]["choices"][0]["finish_reason"] == "length"
    # one character a token: the reasoning arrives in pieces, as it is generated
    assert sum("reasoning_content" in ch["delta"] for f in frames for ch in f["choices"]) == (
        len("two steps") if include_reasoning else 0
    )


def test_without_a_parser_the_answer_is_returned_as_generated() -> None:
    app = create_app(LoraStarConfig(async_engine=FakeAsyncLLM()))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        msg = c.post("/v1/chat/completions", json=_chat()).json()["choices"][0]["message"]
    assert msg["content"] == ANSWER and msg["reasoning_content"] is None


def test_an_earlier_answers_thinking_reaches_the_template(http: httpx.Client, fake: FakeAsyncLLM) -> None:
    """Interleaved thinking: an assistant turn sent back with its reasoning (either name) reaches
    the chat template as ``reasoning_content``, the name Qwen3's and DeepSeek's templates read."""
    for name in ("reasoning_content", "reasoning"):
        history = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", name: "thought"},
            {"role": "user", "content": "q2"},
        ]
        r = http.post(
            "/v1/chat/completions", json={"model": "fake-model", "messages": history, "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        messages, _ = fake.rendered[-1]
        assert messages[1] == {"role": "assistant", "content": "a", "reasoning_content": "thought"}
        assert "reasoning_content" not in messages[0]
