"""Request ids from clients and gateways, as vLLM takes them: ``X-Request-Id`` (else the body's
``request_id``) names the answer ``chatcmpl-{id}`` / ``cmpl-{id}``; a repeated id still serves each
request on its own; ``--enable-request-id-headers`` echoes the header on lorastar's answers."""

from __future__ import annotations

import concurrent.futures
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from plugin_support import engine_config, serve_config

from lorastar.plugin.schemas import MAX_REQUEST_ID

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]


def greedy(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 8, "temperature": 0, **kw}


def test_the_header_or_the_body_names_the_answer(real_server: Any) -> None:
    url = real_server.url + "/v1"
    r = httpx.post(f"{url}/chat/completions", json=greedy(messages=CHAT), headers={"X-Request-Id": "trace-1"})
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-trace-1"
    r = httpx.post(f"{url}/completions", json=greedy(prompt=PROMPT, request_id="body-2"))
    assert r.status_code == 200 and r.json()["id"] == "cmpl-body-2"
    # The header wins over the body (vLLM's order).
    r = httpx.post(
        f"{url}/completions",
        json=greedy(prompt=PROMPT, request_id="body-3"),
        headers={"x-request-id": "hdr-3"},
    )
    assert r.json()["id"] == "cmpl-hdr-3"
    # Streamed: every chunk carries it.
    with httpx.stream(
        "POST",
        f"{url}/chat/completions",
        json=greedy(messages=CHAT, stream=True),
        headers={"X-Request-Id": "s-4"},
    ) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    assert chunks and {c["id"] for c in chunks} == {"chatcmpl-s-4"}
    # Without either, a random id as before.
    r = httpx.post(f"{url}/chat/completions", json=greedy(messages=CHAT))
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", r.json()["id"])


def test_a_repeated_id_serves_each_request(real_server: Any, offline_llm: Any) -> None:
    """Retries and one gateway trace reuse ids: eight concurrent requests under one id (two prompts
    each: the engine ids of a completions batch) all answer, each with its own greedy text."""
    from lorastar import SamplingParams

    prompts = [[PROMPT, f"{i} + {i} ="] for i in range(8)]
    want = [
        [o.outputs[0].text for o in offline_llm.generate(p, SamplingParams(temperature=0, max_tokens=8))]
        for p in prompts
    ]

    def ask(p: list[str]) -> Any:
        return httpx.post(
            real_server.url + "/v1/completions",
            json=greedy(prompt=p),
            headers={"X-Request-Id": "same"},
            timeout=120,
        )

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, prompts))
    assert [a.status_code for a in answers] == [200] * 8, answers[0].text
    assert [
        [c["text"] for c in sorted(a.json()["choices"], key=lambda c: c["index"])] for a in answers
    ] == want
    assert {a.json()["id"] for a in answers} == {"cmpl-same"}


def test_an_overlong_id_is_a_400_naming_it(real_server: Any) -> None:
    url = real_server.url + "/v1/chat/completions"
    long = "x" * (MAX_REQUEST_ID + 1)
    r = httpx.post(url, json=greedy(messages=CHAT, request_id=long))
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
    r = httpx.post(url, json=greedy(messages=CHAT), headers={"X-Request-Id": long})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
    # Off by default: no header echoed.
    r = httpx.post(url, json=greedy(messages=CHAT), headers={"X-Request-Id": "t"})
    assert r.status_code == 200 and "x-request-id" not in r.headers


def test_enable_request_id_headers_echoes_or_makes_one(tiny_model_dir: Path) -> None:
    from litestar import Litestar, get
    from litestar.testing import TestClient

    from lorastar.plugin import LoraStarConfig, LoraStarPlugin

    @get("/mine")
    async def mine() -> str:
        return "app's own"

    plugin = LoraStarPlugin(
        LoraStarConfig(
            engine=engine_config(tiny_model_dir), served_model_name="tiny", enable_request_id_headers=True
        )
    )
    with TestClient(Litestar(route_handlers=[mine], plugins=[plugin])) as c:
        r = c.post("/v1/completions", json=greedy(prompt=PROMPT), headers={"X-Request-Id": "gw-1"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "gw-1" and r.json()["id"] == "cmpl-gw-1"
        with c.stream("POST", "/v1/completions", json=greedy(prompt=PROMPT, stream=True)) as s:
            made = s.headers["x-request-id"]
            assert s.read().endswith(b"data: [DONE]\n\n")
        assert re.fullmatch(r"[0-9a-f]{32}", made)
        for method, path, status in [
            ("get", "/v1/models", 200),
            ("get", "/health", 200),
            ("post", "/tokenize", 200),
            ("post", "/v1/chat/completions", 400),  # refused: still answered with the id
        ]:
            kw = (
                {"json": {"prompt": "hi"}}
                if path == "/tokenize"
                else {"json": {}}
                if method == "post"
                else {}
            )
            r = getattr(c, method)(path, headers={"X-Request-Id": f"id-{path}"}, **kw)
            assert r.status_code == status and r.headers["x-request-id"] == f"id-{path}", (path, r.text)
        assert "x-request-id" not in c.get("/mine").headers  # the app's own routes are left alone


def test_serve_flag_reaches_the_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    for flags, want in [([], False), (["--enable-request-id-headers"], True)]:
        r, config = serve_config(monkeypatch, [str(tmp_path), "--port", "0", *flags])
        assert r.exit_code == 0, r.output
        assert config.enable_request_id_headers is want
