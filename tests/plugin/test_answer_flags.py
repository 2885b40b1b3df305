"""vLLM's answer flags: ``--return-tokens-as-token-ids`` (a default a request's own field overrides),
``--enable-force-include-usage`` (streams end with usage, asked for or not) and ``--response-role``
(chat answers' role; the last message's with ``add_generation_prompt: false``), as vLLM's frontend
applies them; ``--enable-prompt-tokens-details`` is accepted (usage always carries the details)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient
from plugin_support import serve_config

from lorastar.config import EngineConfig
from lorastar.plugin import LoraStarConfig, create_app

FAST = {"cpu_gemm": "torch", "cpu_kernels": "torch", "num_kv_blocks": 32, "max_model_len": 128}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "temperature": 0}
COMPLETION = {"prompt": "hello there", "max_tokens": 3, "temperature": 0}


def _client(model: Path, **cfg: Any) -> TestClient[Any]:
    return TestClient(create_app(LoraStarConfig(engine=EngineConfig(model=str(model), **FAST), **cfg)))


def _events(c: TestClient[Any], route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with c.stream("POST", route, json={**body, "stream": True}) as s:
        assert s.status_code == 200
        lines = [ln[len("data: ") :] for ln in "".join(s.iter_text()).splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


@pytest.fixture(scope="module")
def flagged(tiny_model_dir: Path) -> Any:
    with _client(
        tiny_model_dir, return_tokens_as_token_ids=True, enable_force_include_usage=True, response_role="bot"
    ) as c:
        yield c


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> Any:
    with _client(tiny_model_dir) as c:
        yield c


def test_logprob_tokens_are_token_ids_unless_the_request_says_no(flagged: Any, plain: Any) -> None:
    body = {**COMPLETION, "logprobs": 2, "return_token_ids": True}
    on = flagged.post("/v1/completions", json=body).json()["choices"][0]
    assert on["logprobs"]["tokens"] == [f"token_id:{i}" for i in on["token_ids"]]
    assert all(k.startswith("token_id:") for top in on["logprobs"]["top_logprobs"] for k in top)
    off = flagged.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()[
        "choices"
    ][0]
    ref = plain.post("/v1/completions", json=body).json()["choices"][0]
    assert off["logprobs"] == ref["logprobs"] and off["token_ids"] == on["token_ids"] == ref["token_ids"]
    assert not any(t.startswith("token_id:") for t in ref["logprobs"]["tokens"])
    # a request of the plain server can still ask for ids
    asked = plain.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()
    assert asked["choices"][0]["logprobs"]["tokens"] == on["logprobs"]["tokens"]
    # chat: the same, streamed
    chat = {**CHAT, "logprobs": True, "top_logprobs": 1, "return_token_ids": True}
    events = _events(flagged, "/v1/chat/completions", chat)
    ids = [i for e in events for ch in e["choices"] for i in ch.get("token_ids") or []]
    tokens = [
        t["token"]
        for e in events
        for ch in e["choices"]
        for t in (ch.get("logprobs") or {}).get("content", [])
    ]
    assert len(ids) == 3 and tokens == [f"token_id:{i}" for i in ids]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_streams_end_with_usage_when_forced(flagged: Any, plain: Any, route: str) -> None:
    body = COMPLETION if route == "/v1/completions" else CHAT
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (cached_tokens: the cache's state)
    whole = {k: plain.post(route, json=body).json()["usage"][k] for k in counts}
    for extra in ({}, {"stream_options": {"include_usage": False}}):
        events = _events(flagged, route, {**body, **extra})
        assert events[-1]["choices"] == [] and {k: events[-1]["usage"][k] for k in counts} == whole
        assert all(e.get("usage") is None for e in events[:-1])  # not continuous: not asked for
    events = _events(flagged, route, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all(e.get("usage") for e in events)  # continuous, as asked, now that usage is on
    # without the flag, nothing unasked
    assert all(e.get("usage") is None for e in _events(plain, route, body))


def test_chat_answers_take_the_response_role(flagged: Any, plain: Any) -> None:
    r = flagged.post("/v1/chat/completions", json=CHAT).json()
    assert r["choices"][0]["message"]["role"] == "bot"
    assert (
        plain.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["role"] == "assistant"
    )
    first = _events(flagged, "/v1/chat/completions", CHAT)[0]
    assert first["choices"][0]["delta"] == {"role": "bot", "content": ""}
    # the answer continues the last message: its role, as vLLM's
    cont = {
        **CHAT,
        "messages": [*CHAT["messages"], {"role": "assistant", "content": "Well,"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    assert (
        flagged.post("/v1/chat/completions", json=cont).json()["choices"][0]["message"]["role"] == "assistant"
    )
    assert _events(flagged, "/v1/chat/completions", cont)[0]["choices"][0]["delta"]["role"] == "assistant"


def test_an_empty_response_role_is_refused() -> None:
    with pytest.raises(ValueError, match="response_role"):
        LoraStarConfig(response_role=" ")


def test_serve_takes_the_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    r, config = serve_config(monkeypatch, [str(tmp_path), "--port", "0"])
    assert r.exit_code == 0, r.output
    assert (config.return_tokens_as_token_ids, config.enable_force_include_usage, config.response_role) == (
        False,
        False,
        "assistant",
    )
    flags = ["--return-tokens-as-token-ids", "--enable-force-include-usage", "--response-role", "bot",
             "--enable-prompt-tokens-details"]  # fmt: skip
    r, config = serve_config(monkeypatch, [str(tmp_path), "--port", "0", *flags])
    assert r.exit_code == 0, r.output
    assert (config.return_tokens_as_token_ids, config.enable_force_include_usage, config.response_role) == (
        True,
        True,
        "bot",
    )
    r, config = serve_config(monkeypatch, [str(tmp_path), "--port", "0", "--response-role", ""])
    assert r.exit_code == 2 and "response_role" in r.output and config is None, r.output
