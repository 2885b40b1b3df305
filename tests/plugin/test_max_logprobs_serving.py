"""``EngineConfig.max_logprobs`` through the HTTP routes, with the engine in the server's process and
in a core process of its own (the cap crosses in its ``Ready``): up to the cap every route returns
that many top logprobs; over it, a 400 names the field the client sent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from plugin_support import ServerThread, engine_config

CAP = 30
CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def url(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[str]:
    from lorastar.plugin import LoraStarConfig, create_app

    config = LoraStarConfig(
        engine=engine_config(tiny_model_dir, max_logprobs=CAP),
        served_model_name="tiny",
        engine_process=request.param == "engine-process",
    )
    with ServerThread(create_app(config)) as srv:
        yield srv.url + "/v1"


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json={"model": "tiny", **body}, timeout=60)


def test_up_to_the_cap_every_route_returns_that_many(url: str) -> None:
    r = _post(url, "/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": CAP})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == CAP for c in content)
    for c in content:
        values = [t["logprob"] for t in c["top_logprobs"]]
        assert values == sorted(values, reverse=True) and c["logprob"] == values[0]  # greedy

    body = {"prompt": "One, two, three,", "max_tokens": 2, "temperature": 0, "logprobs": CAP - 1}
    r = _post(url, "/completions", {**body, "prompt_logprobs": CAP})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert all(len(top) == CAP - 1 for top in choice["logprobs"]["top_logprobs"])
    prompt_lps = choice["prompt_logprobs"]
    assert prompt_lps[0] is None and all(len(e) >= CAP for e in prompt_lps[1:])  # and the prompt token

    r = _post(url, "/responses", {"input": "Say hi", "max_output_tokens": 3, "temperature": 0,
                                  "top_logprobs": CAP, "include": ["message.output_text.logprobs"]})  # fmt: skip
    assert r.status_code == 200, r.text
    (part,) = r.json()["output"][-1]["content"]
    assert part["logprobs"] and all(len(lp["top_logprobs"]) == CAP for lp in part["logprobs"])


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": CAP + 1}, "top_logprobs"),
        ("/chat/completions", {**CHAT, "prompt_logprobs": CAP + 1}, "prompt_logprobs"),
        ("/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": CAP + 1}, "logprobs"),
        ("/completions", {"prompt": "hi", "max_tokens": 1, "echo": True, "logprobs": CAP + 1}, "logprobs"),
        ("/responses", {"input": "hi", "max_output_tokens": 1, "top_logprobs": CAP + 1}, "top_logprobs"),
    ],
)
def test_over_the_cap_is_a_400_naming_the_field_sent(url: str, path: str, body: dict, param: str) -> None:
    r = _post(url, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and f"at most {CAP} (max_logprobs), got {CAP + 1}" in error["message"]
    assert error["message"].startswith(param)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": -1}, "logprobs"),
        ("/completions", {"prompt": "hi", "max_tokens": 1, "prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_minus_one_over_the_cap_is_a_400_naming_the_field_sent(
    url: str, path: str, body: dict, param: str
) -> None:
    r = _post(url, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(
        f"{param}=-1 asks for the whole vocabulary"
    )
    assert f"at most {CAP} (max_logprobs)" in error["message"]


@pytest.fixture(scope="module")
def uncapped(tiny_model_dir: Path) -> Iterator[str]:
    from lorastar.plugin import LoraStarConfig, create_app

    config = LoraStarConfig(engine=engine_config(tiny_model_dir, max_logprobs=-1), served_model_name="tiny")
    with ServerThread(create_app(config)) as srv:
        yield srv.url + "/v1"


def test_minus_one_returns_the_whole_vocabulary_when_uncapped(uncapped: str) -> None:
    """vLLM's -1: every token's logprob, at each sampled position (chat) and each prompt position
    (completions' ``prompt_logprobs``, and its ``echo`` with ``logprobs``)."""
    vocab = 49152  # SmolLM2's tokenizer
    body = {**CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": -1}
    r = _post(uncapped, "/chat/completions", body)
    assert r.status_code == 200, r.text
    (content,) = r.json()["choices"][0]["logprobs"]["content"]
    values = [t["logprob"] for t in content["top_logprobs"]]
    assert len(values) == vocab and values == sorted(values, reverse=True)
    assert len({t["token"] for t in content["top_logprobs"]}) > vocab // 2  # distinct tokens, not a repeat

    body = {"prompt": "Hello there", "max_tokens": 1, "logprobs": 2, "prompt_logprobs": -1}
    r = _post(uncapped, "/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert all(len(top) <= 3 for top in choice["logprobs"]["top_logprobs"])  # top 2 and the chosen one
    assert choice["prompt_logprobs"][0] is None and all(
        len(e) == vocab for e in choice["prompt_logprobs"][1:]
    )

    body = {"prompt": "Hello there", "max_tokens": 0, "echo": True, "logprobs": -1}
    r = _post(uncapped, "/completions", body)
    assert r.status_code == 200, r.text
    tops = r.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert tops[0] is None and len(tops) > 1
    assert all(len(top) > vocab // 2 for top in tops[1:])  # keyed by text: tokens that decode alike merge
