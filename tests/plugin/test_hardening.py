"""Issue #10's reproductions against the plugin on a real tiny-model engine: each one gets a 4xx
in the OpenAI error shape naming the right ``param`` (or is served within the limits), and the
engine keeps serving with ``/health`` at 200 throughout."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from plugin_support import engine_config

ADMIN = {"Authorization": "Bearer adm"}


@pytest.fixture(scope="module")
def hostile_root(adapter_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile-adapters")
    shutil.copytree(adapter_root / "alpha", root / "alpha")
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text("{")
    os.symlink(root / "loop2", root / "loop1")
    os.symlink(root / "loop1", root / "loop2")
    return root


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path, hostile_root: Path) -> Iterator[Any]:
    from litestar import Litestar
    from litestar.testing import TestClient

    from lorastar.plugin import LoraStarConfig, LoraStarPlugin

    plugin = LoraStarPlugin(
        LoraStarConfig(
            engine=engine_config(tiny_model_dir, num_kv_blocks=64),
            served_model_name="tiny",
            adapters={"alpha": str(hostile_root / "alpha")},
            adapter_root=hostile_root,
            admin_token="adm",
            enable_adapter_resolver=True,
            api_keys=["key"],
            metrics_require_api_key=True,
        )
    )
    with TestClient(Litestar(plugins=[plugin])) as c:
        c.headers.update({"Authorization": "Bearer key"})
        c.plugin = plugin  # type: ignore[attr-defined]
        yield c


CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
CASES: list[tuple[str, str, Any, int, str | None]] = [
    # (route, json body or raw bytes, expected status, expected param)
    (
        "r1",
        CMPL,
        {"prompt": "hello there", "max_tokens": 4, "repetition_penalty": 1e-300},
        400,
        "repetition_penalty",
    ),
    ("r1", CMPL, {"prompt": "hello there", "temperature": 1e300, "min_tokens": 2}, 400, "temperature"),
    (
        "r1",
        CMPL,
        {"prompt": "hi", "max_tokens": 1, "repetition_penalty": 1e-300, "logprobs": 1},
        400,
        "repetition_penalty",
    ),
    ("r2", CMPL, {"prompt": "hello", "n": 1000000}, 400, "n"),
    ("r2", CMPL, {"prompt": "hello", "n": 10000}, 400, "n"),
    ("r3", CMPL, {"prompt": "hello", "max_tokens": 2, "use_beam_search": True, "n": 600}, 400, "n"),
    ("r3", CMPL, {"prompt": "hello", "max_tokens": 200, "use_beam_search": True, "n": 100}, 400, "n"),
    # beam search reports each hypothesis token's logprobs (it refused them, once they had been
    # null / -9999 placeholders)
    (
        "beam-lp",
        CMPL,
        {"prompt": "hello", "max_tokens": 2, "use_beam_search": True, "n": 2, "logprobs": 2},
        200,
        None,
    ),
    (
        "beam-lp",
        CMPL,
        {"prompt": "hi", "max_tokens": 2, "use_beam_search": True, "echo": True, "logprobs": 0},
        200,
        None,
    ),
    (
        "beam-lp",
        CHAT,
        {
            "messages": HI,
            "max_tokens": 2,
            "use_beam_search": True,
            "n": 2,
            "logprobs": True,
            "top_logprobs": 2,
        },
        200,
        None,
    ),
    (
        "beam-lp",
        CHAT,
        {"messages": HI, "max_tokens": 2, "use_beam_search": True, "logprobs": True},
        200,
        None,
    ),
    (
        "beam-lp",
        CHAT,
        {"messages": HI, "max_tokens": 2, "use_beam_search": True, "logprobs": False},
        200,
        None,
    ),
    ("r4", CMPL, {"prompt": "x" * 9_000_000}, 400, "prompt"),
    ("r4", CHAT, {"messages": [{"role": "user", "content": "x" * 9_000_000}]}, 400, "messages"),
    ("r5", CMPL, {"prompt": "hello", "stop": ["a" * 200] * 10000}, 400, "stop"),
    ("r5", CMPL, {"prompt": "hello", "stop": ["a" * 1000]}, 400, "stop"),
    ("r5", CMPL, {"prompt": "hello", "stop_token_ids": list(range(5000))}, 400, "stop_token_ids"),
    # a whole-vocabulary bias with n = 128 made every step of the server take ~10x longer
    (
        "r5",
        CMPL,
        {"prompt": "hi", "n": 128, "logit_bias": {str(i): 0.5 for i in range(5000)}},
        400,
        "logit_bias",
    ),
    ("r6", CHAT, {"messages": [{"role": ["user"], "content": "hi"}]}, 400, "messages"),
    ("r6", CHAT, {"messages": [{"role": {"a": 1}, "content": "hi"}]}, 400, "messages"),
    ("r6", CHAT, b'{"messages":' + b"[" * 10000 + b"]" * 10000 + b"}", 400, None),
    ("r6", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "a" * 300}, 400, "lora_path"),
    ("r6", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "loop1"}, 400, "lora_path"),
    ("r6", CMPL, {"prompt": "hello", "model": "m" * 300}, 404, "model"),
    ("r9", CMPL, {"prompt": "hello", "seed": 10**30}, 400, "seed"),
    ("r9", CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("r9", CHAT, {"messages": HI, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("r9", CMPL, b'{"prompt":"hi","temperature":1e999}', 400, "temperature"),
    ("ok", CMPL, {"prompt": "hello", "n": 3, "max_tokens": 3}, 200, None),
    (
        "ok",
        CMPL,
        {"prompt": "hi", "n": 4, "max_tokens": 3, "logit_bias": {str(i): 0.5 for i in range(1024)}},
        200,
        None,
    ),
    ("ok", CMPL, {"prompt": "hello", "max_tokens": 3, "use_beam_search": True, "n": 3}, 200, None),
]


@pytest.mark.parametrize(
    ("repro", "route", "body", "status", "param"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_reproductions(
    client: Any, repro: str, route: str, body: Any, status: int, param: str | None
) -> None:
    headers = ADMIN if "lora" in route else {}
    t0 = time.monotonic()
    if isinstance(body, bytes):
        r = client.post(route, content=body, headers={**headers, "content-type": "application/json"})
    else:
        r = client.post(route, json=body, headers=headers)
    assert r.status_code == status, r.text[:300]
    if status >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
        assert err["param"] == param, err
        assert "Traceback" not in r.text and "Internal" not in r.text
        assert time.monotonic() - t0 < 5  # refused up front: nothing was tokenized or generated
    assert client.get("/health").status_code == 200


def test_engine_serves_after_every_reproduction(client: Any) -> None:
    r = client.post(CMPL, json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    engine = client.plugin.engine.engine
    engine.check_invariants()
    assert engine.kv_cache_usage().num_used_blocks == 0 and not engine.requests


def test_unknown_routes_and_methods_speak_openai(client: Any) -> None:
    for r in (client.get(CMPL), client.get("/v1/no-such-route"), client.delete("/v1/models")):
        assert r.status_code in (404, 405)
        assert r.json()["error"]["code"] == r.status_code
    empty = client.post(CMPL, content=b"", headers={"content-type": "application/json"})
    assert empty.status_code == 400 and "'data'" not in empty.json()["error"]["message"]


def test_no_server_paths_reach_clients(client: Any, hostile_root: Path) -> None:
    models = client.get("/v1/models").json()["data"]
    assert [m["root"] for m in models if m["id"] == "alpha"] == ["alpha"]
    assert all(str(hostile_root) not in str(m) and not str(m["root"]).startswith("/") for m in models)
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "broken"}, headers=ADMIN)
    assert r.status_code == 400 and str(hostile_root) not in r.text and "broken" in r.text
    names = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert "b" not in names  # a failed load changes nothing


def test_metrics_can_require_an_api_key(client: Any) -> None:
    assert client.get("/metrics").status_code == 200
    anonymous = client.get("/metrics", headers={"Authorization": ""})
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == 401


def test_server_queue_is_bounded_by_default() -> None:
    from lorastar.plugin import LoraStarConfig
    from lorastar.plugin.config import DEFAULT_MAX_WAITING

    assert LoraStarConfig().engine_config().max_waiting == DEFAULT_MAX_WAITING == 256


def test_logit_bias_applies_and_names_bad_ids(client: Any) -> None:
    """OpenAI's logit_bias (token ids as strings): +100 forces a token, -100 bans the greedy one;
    an id outside the vocabulary is a 400 naming logit_bias."""
    base = {"prompt": "hello there", "max_tokens": 4, "temperature": 0, "logprobs": 0}
    plain = client.post(CMPL, json=base).json()
    first = plain["choices"][0]["logprobs"]["tokens"][0]
    vocab = client.plugin.engine.engine.vocab_size
    tokenizer = client.plugin.engine.tokenizer
    (tok_id,) = tokenizer.encode(first, add_special_tokens=False)
    banned = client.post(CMPL, json={**base, "logit_bias": {str(tok_id): -100}}).json()
    assert banned["choices"][0]["logprobs"]["tokens"][0] != first
    forced = client.post(CMPL, json={**base, "logit_bias": {"42": 100}}).json()
    assert forced["usage"]["completion_tokens"] == 4
    assert forced["choices"][0]["logprobs"]["tokens"] == [tokenizer.decode([42])] * 4
    chat = client.post(
        CHAT, json={"messages": HI, "max_tokens": 2, "temperature": 0, "logit_bias": {"42": 100}}
    )
    assert chat.status_code == 200
    for bias in ({str(vocab): 1}, {"-1": 1}, {"x": 1}):
        r = client.post(CMPL, json={**base, "logit_bias": bias})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_allowed_token_ids_limit_the_output_and_name_bad_ids(client: Any) -> None:
    """vLLM's allowed_token_ids on both routes: every generated id is one of them; an id outside
    the vocabulary or an empty list is a 400 naming the field."""
    allowed = [28, 30, 253, 314, 1345]
    body = {"prompt": "hello there", "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 3, "logprobs": 0}
    r = client.post(CMPL, json={**body, "allowed_token_ids": allowed}).json()
    tokenizer = client.plugin.engine.tokenizer
    words = {tokenizer.decode([t]) for t in allowed}
    assert all(set(c["logprobs"]["tokens"]) <= words for c in r["choices"]), r
    chat = {"messages": HI, "max_tokens": 4, "temperature": 0, "logprobs": True, "allowed_token_ids": allowed}
    content = client.post(CHAT, json=chat).json()["choices"][0]["logprobs"]["content"]
    assert {c["token"] for c in content} <= words
    vocab = client.plugin.engine.engine.vocab_size
    for bad in ([vocab], [], [-1]):
        r = client.post(CMPL, json={**body, "allowed_token_ids": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text


def test_adapter_id_selects_an_adapter_like_model(client: Any) -> None:
    """LoRAX's adapter_id picks the adapter as `model` does; unknown is 404, a contradiction 400."""
    base = {"prompt": "hello there", "max_tokens": 6, "temperature": 0}
    by_model = client.post(CMPL, json={**base, "model": "alpha"}).json()["choices"][0]["text"]
    by_id = client.post(CMPL, json={**base, "adapter_id": "alpha"}).json()["choices"][0]["text"]
    plain = client.post(CMPL, json=base).json()["choices"][0]["text"]
    assert by_id == by_model != plain
    chat = client.post(CHAT, json={"messages": HI, "max_tokens": 4, "temperature": 0, "adapter_id": "alpha"})
    assert chat.status_code == 200
    unknown = client.post(CMPL, json={**base, "adapter_id": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "adapter_id"
    clash = client.post(CHAT, json={"messages": HI, "model": "alpha", "adapter_id": "other"})
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "adapter_id"
