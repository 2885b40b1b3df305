"""Scoring over HTTP: echo with prompt logprobs, ``max_tokens: 0``, vLLM's ``prompt_logprobs``.

The real server (uvicorn + the engine on the tiny model) against the offline ``LLM`` on the same
weights, whose prompt logprobs are themselves tested against HF transformers and PEFT in
``tests/engine/test_prompt_logprobs.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from plugin_support import ServerThread, engine_config

PROMPT = "The capital of France is"
TOL = 1e-4


@pytest.fixture(scope="module")
def http(real_server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=real_server.url + "/v1", timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, adapter_root: Path) -> Any:
    from lorastar import LLM

    llm = LLM(config=engine_config(tiny_model_dir))
    llm.load_adapter("alpha", str(adapter_root / "alpha"))
    return llm


def _ref(reference: Any, prompt: Any, k: int, adapter: str | None = None) -> Any:
    from lorastar import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k)
    return reference.generate(prompt, params, adapter=adapter)[0]


@pytest.mark.parametrize("model", ["tiny", "alpha"])
def test_echo_returns_the_prompts_logprobs_from_offset_zero(
    http: httpx.Client, reference: Any, model: str
) -> None:
    want = _ref(reference, PROMPT, 2, None if model == "tiny" else model)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 2}
    r = http.post("/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    ids = want.prompt_token_ids
    p = len(ids)
    assert len(lp["tokens"]) == p + 2
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for pos in range(1, p):
        entry = want.prompt_logprobs[pos]
        assert abs(lp["token_logprobs"][pos] - entry[ids[pos]].logprob) <= TOL
        top = lp["top_logprobs"][pos]
        best = sorted(entry.values(), key=lambda x: x.rank)[:2]
        assert len(top) >= 2 and all(abs(top[b.decoded_token] - b.logprob) <= TOL for b in best)
    assert all(v is not None for v in lp["token_logprobs"][1:])  # generated tokens too
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    # Offsets index the returned text: each token's text starts where its offset says.
    text = choice["text"]
    assert text.startswith(PROMPT)
    gen0 = p  # the first generated token
    assert offsets[gen0] == len(PROMPT)
    assert text[offsets[gen0] :].startswith(lp["tokens"][gen0])


def test_echo_with_max_tokens_zero_scores_the_prompt_alone(http: httpx.Client, reference: Any) -> None:
    want = _ref(reference, PROMPT, 1)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    r = http.post("/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    assert choice["text"] == PROMPT
    assert choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0
    assert out["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    lp = choice["logprobs"]
    ids = want.prompt_token_ids
    assert len(lp["token_logprobs"]) == len(ids)
    total = sum(lp["token_logprobs"][1:])
    assert abs(total - sum(want.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids)))) <= 1e-3

    # Streamed: one frame with the prompt and its logprobs, then [DONE].
    with http.stream("POST", "/completions", json={**body, "stream": True}) as s:
        frames = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT
    streamed = [v for c in chunks for v in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
    assert streamed == lp["token_logprobs"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_lm_eval_style_batch_of_token_prompts(http: httpx.Client, reference: Any) -> None:
    """What lm-eval's local-completions sends for loglikelihood: token-id prompts, echo,
    max_tokens 1, logprobs 1; it sums ``token_logprobs[ctxlen:-1]``."""
    ids_a = reference.engine.tokenize("Paris is the capital of France")
    ids_b = reference.engine.tokenize("The sky is blue")
    body = {
        "model": "tiny",
        "prompt": [ids_a, ids_b],
        "max_tokens": 1,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
    }
    r = http.post("/completions", json=body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for ids, choice in zip((ids_a, ids_b), choices):
        want = _ref(reference, ids, 1)
        got = choice["logprobs"]["token_logprobs"][1:-1]
        assert len(got) == len(ids) - 1
        for pos, v in enumerate(got, start=1):
            assert abs(v - want.prompt_logprobs[pos][ids[pos]].logprob) <= TOL
        for tok, top in zip(got, choice["logprobs"]["top_logprobs"][1:-1]):
            assert tok <= max(top.values()) + 1e-6  # is_greedy is computable


def test_prompt_logprobs_on_completions_and_chat(http: httpx.Client, reference: Any) -> None:
    want = _ref(reference, PROMPT, 3)
    r = http.post(
        "/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 3}
    )
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    ids = want.prompt_token_ids
    assert got[0] is None and len(got) == len(ids)
    for pos in range(1, len(ids)):
        entry = got[pos]
        assert str(ids[pos]) in entry
        assert sum(1 for v in entry.values() if v["rank"] <= 3) == 3  # the top 3 (+ the prompt token)
        for t, v in entry.items():
            ref = want.prompt_logprobs[pos][int(t)]
            assert abs(v["logprob"] - ref.logprob) <= TOL and v["rank"] == ref.rank
            assert v["decoded_token"] == ref.decoded_token

    messages = [{"role": "user", "content": "Name three colours."}]
    r = http.post(
        "/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 2, "prompt_logprobs": 0},
    )
    assert r.status_code == 200, r.text
    out = r.json()
    chat_ids = reference.engine.apply_chat_template(messages)
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == len(chat_ids)
    assert all(list(e) == [str(t)] for e, t in zip(out["prompt_logprobs"][1:], chat_ids[1:]))
    # Not asked for: null, as before.
    plain = http.post("/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ("/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "n": 2}, "n"),
        ("/completions", {"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/completions", {"prompt": PROMPT, "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 99},
            "prompt_logprobs",
        ),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1, "stream": True},
            "prompt_logprobs",
        ),
    ],
)
def test_bad_scoring_requests_name_the_field(http: httpx.Client, path: str, body: dict, param: str) -> None:
    r = http.post(path, json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
