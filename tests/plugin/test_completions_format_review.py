"""The response formats of ``/v1/completions`` (echo, legacy logprobs, n, several prompts, streams),
chat's logprobs and ``/tokenize`` against vLLM's OpenAI server, on the shared live server."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
from transformers import AutoTokenizer


def _post(srv: Any, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(srv.url + route, json=body, timeout=60)


def _sse(srv: Any, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    frames: list[dict[str, Any]] = []
    with httpx.stream("POST", srv.url + route, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                frames.append(json.loads(line[6:]))
    return frames


def test_default_max_tokens_is_per_prompt(real_server: Any) -> None:
    """Without ``max_tokens`` each prompt gets vLLM's 16, cut to what its own context leaves: a long
    prompt in the batch must not shorten the others' completions (``get_max_tokens`` per prompt)."""
    long_ids = [2229] * 245  # 11 tokens of room left in max_model_len 256
    body = {"model": "tiny", "prompt": [[19556, 905], long_ids], "temperature": 0, "ignore_eos": True}
    r = _post(real_server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["usage"]["completion_tokens"] == 16 + 11
    assert [c["finish_reason"] for c in j["choices"]] == ["length", "length"]
    frames = _sse(
        real_server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert frames[-1]["usage"]["completion_tokens"] == 16 + 11


def _check_legacy_logprobs(lp: dict[str, Any], text: str, num_top: int, echoed: int) -> None:
    """vLLM's legacy shape: one entry per token; the first echoed token has no logprob and no top
    entries; ``text_offset`` is cumulative over the token strings; top entries are the top
    ``num_top`` plus the chosen token, keyed by token text."""
    tokens, offsets = lp["tokens"], lp["text_offset"]
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(offsets) == len(tokens)
    assert "".join(tokens) == text
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    if echoed:
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1 if echoed else 0, len(tokens)):
        top = lp["top_logprobs"][i]
        assert tokens[i] in top and top[tokens[i]] == lp["token_logprobs"][i]
        assert num_top <= len(top) <= num_top + 1 and max(top.values()) <= 0


def test_echo_logprobs_plain_and_streamed(real_server: Any) -> None:
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 3, "temperature": 0, "echo": True}
    r = _post(real_server, "/v1/completions", {**body, "logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].startswith("Hello world")
    _check_legacy_logprobs(choice["logprobs"], choice["text"], 2, echoed=2)
    assert len(choice["logprobs"]["tokens"]) == 2 + 3
    # streamed: the prompt with the first frame, the offsets going on from the text sent
    frames = _sse(real_server, "/v1/completions", {**body, "logprobs": 2, "stream": True})
    got = [f["choices"][0] for f in frames]
    assert "".join(c["text"] for c in got) == choice["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in got for x in c["logprobs"][key]] == choice["logprobs"][key]
    assert [c["finish_reason"] for c in got][-1] == "length"
    # max_tokens 0: the prompt alone (lm-eval's loglikelihood), logprobs=0: the chosen token only
    r = _post(real_server, "/v1/completions", {**body, "max_tokens": 0, "logprobs": 0})
    assert r.status_code == 200, r.text
    j = r.json()
    choice = j["choices"][0]
    assert choice["text"] == "Hello world" and j["usage"]["completion_tokens"] == 0
    _check_legacy_logprobs(choice["logprobs"], "Hello world", 0, echoed=2)
    assert choice["logprobs"]["tokens"] == ["Hello", " world"]


def test_several_prompts_and_n_index_order_and_usage(real_server: Any) -> None:
    """Prompt i, sample j is choice i*n + j (plain and streamed); usage counts each prompt once."""
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="x", max_retries=0)
    kw: dict[str, Any] = dict(
        model="tiny", prompt=["Hi", "Hello there"], n=2, max_tokens=2, echo=True, seed=7, temperature=1.0
    )
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text.startswith("Hello there") for c in r.choices] == [False, False, True, True]
    assert r.usage is not None and r.usage.prompt_tokens == 1 + 2 and r.usage.completion_tokens == 8
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    usage = None
    for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finishes.setdefault(c.index, []).append(c.finish_reason)
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in r.choices}  # seeded: the same samples
    assert finishes == {i: ["length"] for i in range(4)}
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (3, 8)


def test_chat_top_logprobs_bytes(real_server: Any) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }
    r = _post(real_server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode("utf-8", errors="replace"))
        top = entry["top_logprobs"]
        assert len(top) == 2 and top[0]["logprob"] >= top[1]["logprob"]
        assert all(t["bytes"] == list(t["token"].encode("utf-8", errors="replace")) for t in top)


def test_tokenize_messages_and_detokenize_range(real_server: Any, tiny_model_dir: Any) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    msgs = [{"role": "user", "content": "hi"}]
    r = _post(
        real_server,
        "/tokenize",
        {"messages": msgs, "add_generation_prompt": False, "return_token_strs": True},
    )
    assert r.status_code == 200, r.text
    j = r.json()
    want = tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
    assert j["tokens"] == want and j["count"] == len(want) and j["max_model_len"] == 256
    assert j["token_strs"] == tok.convert_ids_to_tokens(want)
    r = _post(real_server, "/detokenize", {"tokens": [1, len(tok)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
