"""Features combined in one request on ``/v1/completions`` and ``/v1/chat/completions`` against vLLM's
OpenAI server: n > 1 with echo, streaming, usage, logprobs, stop strings, seeds, batched prompts and
hidden reasoning with return_token_ids
(fake engine: it answers with its prompt reversed; the tiny real model where sampling matters)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from plugin_fake_engine import FakeAsyncLLM, ScriptedLLM, say
from plugin_support import ServerThread

from lorastar.plugin import LoraStarConfig, create_app


@pytest.fixture(scope="module")
def fake() -> Iterator[httpx.Client]:
    engine = FakeAsyncLLM(step_delay=0)
    with (
        ServerThread(create_app(LoraStarConfig(async_engine=engine))) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as client,
    ):
        yield client


def _events(r: httpx.Response) -> list[Any]:
    assert r.status_code == 200, r.text
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_chat_stream_echo_with_n_sends_every_role_before_the_echoes(fake: httpx.Client) -> None:
    """vLLM's first output: one role chunk per choice, then (echo) one chunk per choice with the
    last message's text, then the generated deltas."""
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "Sure"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "echo": True,
        "n": 2,
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = _events(fake.post("/v1/chat/completions", json=body))
    head = [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks[:4]]
    assert head == [
        (0, {"role": "assistant", "content": ""}),
        (1, {"role": "assistant", "content": ""}),
        (0, {"content": "Sure"}),
        (1, {"content": "Sure"}),
    ]
    prompt = chunks[0]["usage"]["prompt_tokens"]
    assert all(
        c["usage"]["completion_tokens"] == 0 and c["usage"]["prompt_tokens"] == prompt for c in chunks[:4]
    )
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        texts[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content") or ""
    whole = fake.post("/v1/chat/completions", json={**body, "stream": False, "stream_options": None}).json()
    assert texts == {ch["index"]: ch["message"]["content"] for ch in whole["choices"]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_completions_batch_n_stream_echo_logprobs_usage(fake: httpx.Client) -> None:
    """A list of prompts with n: choice ``prompt_index * n + i``, the prompt echoed once per choice
    with logprobs aligned to its text, usage counting each prompt once and every choice's tokens."""
    body = {
        "model": "fake-model",
        "prompt": ["abc", "de"],
        "n": 2,
        "max_tokens": 3,
        "echo": True,
        "logprobs": 1,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = _events(fake.post("/v1/completions", json=body))
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    for c in chunks[:-1]:
        (ch,) = c["choices"]
        i = ch["index"]
        assert ch["logprobs"]["text_offset"][0] == len(texts.get(i, ""))
        texts[i] = texts.get(i, "") + ch["text"]
        tokens.setdefault(i, []).extend(ch["logprobs"]["tokens"])
        assert c["usage"]["prompt_tokens"] == (3 if i < 2 else 2)
    assert sorted(texts) == [0, 1, 2, 3]
    for i, text in texts.items():
        assert text.startswith("abc" if i < 2 else "de")
        assert "".join(tokens[i]) == text
    assert chunks[-1]["usage"]["prompt_tokens"] == 5
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    whole = fake.post("/v1/completions", json={**body, "stream": False, "stream_options": None}).json()
    assert {ch["index"]: ch["text"] for ch in whole["choices"]} == texts
    assert whole["usage"]["prompt_tokens"] == 5 and whole["usage"]["completion_tokens"] == 12


def _assemble(chunks: list[Any], chat: bool) -> dict[int, tuple[str, str | None, Any, int]]:
    """Each choice's (text, finish_reason, stop_reason, number of logprobs) from a stream."""
    out: dict[int, tuple[str, str | None, Any, int]] = {}
    for c in chunks:
        for ch in c["choices"]:
            text, fin, stop, nlp = out.get(ch["index"], ("", None, None, 0))
            lp = ch.get("logprobs") or {}
            text += (ch["delta"].get("content") or "") if chat else ch["text"]
            nlp += len(lp.get("content") or []) if chat else len(lp.get("tokens") or [])
            if ch.get("finish_reason"):
                assert fin is None, "a second finish_reason for one choice"
                fin, stop = ch["finish_reason"], ch.get("stop_reason")
            out[ch["index"]] = (text, fin, stop, nlp)
    return out


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/completions",
            {"model": "alpha", "prompt": ["Hi", "Yo there"], "n": 3, "max_tokens": 8, "stop": ["e", "a"],
             "include_stop_str_in_output": True, "logprobs": 1},
        ),
        (
            "/v1/chat/completions",
            {"model": "beta", "messages": [{"role": "user", "content": "Hi"}], "n": 3, "max_tokens": 8,
             "stop": [" "], "logprobs": True, "top_logprobs": 2},
        ),
    ],
)  # fmt: skip
def test_seeded_n_stream_equals_the_whole_answer(real_server: Any, path: str, body: dict[str, Any]) -> None:
    """seed + n > 1 + stop strings + logprobs on an adapter: the stream spells out the very choices the
    plain response returns (each sample its own generator), one finish per choice, and the same usage."""
    body = {**body, "seed": 11, "temperature": 1.0}
    chat = "chat" in path
    with httpx.Client(base_url=real_server.url, timeout=60) as client:
        whole = client.post(path, json=body).json()
        chunks = _events(
            client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
        )
    streamed = _assemble(chunks[:-1], chat)
    expected = {
        ch["index"]: (
            ch["message"]["content"] if chat else ch["text"],
            ch["finish_reason"],
            ch["stop_reason"],
            len(ch["logprobs"]["content"] if chat else ch["logprobs"]["tokens"]),
        )
        for ch in whole["choices"]
    }
    assert streamed == expected
    assert len({text for text, *_ in expected.values()}) > 1  # the samples differ
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")  # (the second call hits the prefix cache)
    assert [chunks[-1]["usage"][k] for k in keys] == [whole["usage"][k] for k in keys]


@pytest.fixture(scope="module")
def thinking() -> Iterator[httpx.Client]:
    """A server with the qwen3 reasoning parser and hermes tool calls (``ScriptedLLM``)."""
    config = LoraStarConfig(
        async_engine=ScriptedLLM(max_model_len=4096, step_delay=0),
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
    )
    with ServerThread(create_app(config)) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        yield client


@pytest.mark.parametrize("stream", [False, True])
def test_hidden_reasoning_hides_the_answer_token_ids_too(thinking: httpx.Client, stream: bool) -> None:
    """vLLM's: ``include_reasoning: false`` with a reasoning parser drops the choices' ``token_ids``
    (and logprobs) as well: they would spell out the hidden thinking. The prompt's ids stay."""
    answer = "<think>secret plan</think>ok"
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": say(answer)}],
        "max_tokens": len(answer),
        "n": 2,
        "include_reasoning": False,
        "return_token_ids": True,
        "logprobs": True,
        "stream": stream,
    }
    r = thinking.post("/v1/chat/completions", json=body)
    chunks = _events(r) if stream else [r.json()]
    choices = [ch for c in chunks for ch in c["choices"]]
    assert choices and all("token_ids" not in ch and ch["logprobs"] is None for ch in choices)
    assert any("prompt_token_ids" in c for c in chunks)
    first = [(ch["delta"] if stream else ch["message"]) for ch in choices if ch["index"] == 0]
    assert "".join(m.get("content") or "" for m in first) == "ok"  # (choice 1 is the answer shifted)
    # with the reasoning shown, the ids come back
    r = thinking.post("/v1/chat/completions", json={**body, "include_reasoning": True})
    chunks = _events(r) if stream else [r.json()]
    assert any(ch.get("token_ids") for c in chunks for ch in c["choices"])
