"""Sampled-token logprobs against vLLM: what the engine computes and how the OpenAI routes show it."""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest

from lorastar.engine.sampling import SamplingParams

PROMPT_IDS = [19556, 905, 28, 216]  # "Hello world, " in SmolLM2's vocabulary
YES, NO = 10407, 4607  # "yes" and "no": each choice is one token


def _raw_logprob(llm: Any, ids: list[int], token: int) -> float:
    """The model's own logprob of ``token`` after ``ids`` (a prompt logprob: raw, unconstrained)."""
    out = llm.generate([ids + [token]], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    return out.prompt_logprobs[-1][token].logprob


def test_guided_choice_logprobs_are_of_the_grammar_distribution(offline_llm: Any, real_server: Any) -> None:
    """vLLM applies the structured-output bitmask to the logits before its sampler takes the
    logprobs: a constrained step's logprobs are log_softmax over the tokens the grammar allows
    (the chosen one at rank 1 when greedy), every banned token -inf, -9999.0 in the API. They were
    the unconstrained model's: "yes" at rank ~10,000 with forbidden tokens as its top_logprobs."""
    raw_yes, raw_no = _raw_logprob(offline_llm, PROMPT_IDS, YES), _raw_logprob(offline_llm, PROMPT_IDS, NO)
    norm = math.log(math.exp(raw_yes) + math.exp(raw_no))
    want = {YES: raw_yes - norm, NO: raw_no - norm}
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=3, guided_choice=["yes", "no"])
    o = offline_llm.generate([PROMPT_IDS], params)[0].outputs[0]
    first = o.token_ids[0]
    assert first in want
    step = o.logprobs[0]
    assert step[first].rank == 1 and step[first].logprob == pytest.approx(want[first], abs=1e-4)
    other = NO if first == YES else YES
    assert step[other].rank == 2 and step[other].logprob == pytest.approx(want[other], abs=1e-4)
    assert all(lp.logprob == -9999.0 for t, lp in step.items() if t not in want)
    assert o.cumulative_logprob == pytest.approx(sum(s[t].logprob for t, s in zip(o.token_ids, o.logprobs)))

    # the same on the wire (legacy completions and chat)
    body = {
        "model": "tiny",
        "prompt": PROMPT_IDS,
        "max_tokens": 3,
        "temperature": 0,
        "guided_choice": ["yes", "no"],
    }
    r = httpx.post(real_server.url + "/v1/completions", json={**body, "logprobs": 2}, timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] == pytest.approx(want[first], abs=1e-4)
    assert lp["top_logprobs"][0] == pytest.approx({"yes": want[YES], "no": want[NO]}, abs=1e-4)


def test_return_tokens_as_token_ids_names_each_token_by_its_id(real_server: Any) -> None:
    """vLLM's ``return_tokens_as_token_ids`` (RL trainers such as OpenPipe ART read the sampled
    ids back from the logprobs): each token is ``token_id:{id}``, the values unchanged. It was a
    400 "not supported"."""
    import httpx

    with httpx.Client(base_url=real_server.url + "/v1", timeout=60) as c:
        base = {"prompt": [5, 9, 12, 7], "max_tokens": 4, "temperature": 0, "logprobs": 2, "ignore_eos": True}
        plain = c.post("/completions", json=base).json()["choices"][0]["logprobs"]
        r = c.post("/completions", json={**base, "return_tokens_as_token_ids": True, "echo": True})
        assert r.status_code == 200, r.text
        ids = r.json()["choices"][0]["logprobs"]
        assert ids["tokens"][:4] == ["token_id:5", "token_id:9", "token_id:12", "token_id:7"]  # the echo
        assert ids["token_logprobs"][4:] == plain["token_logprobs"]
        assert all(k.startswith("token_id:") for top in ids["top_logprobs"][4:] for k in top)
        msgs = [{"role": "user", "content": "hi"}]
        chat = {"messages": msgs, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2}
        text = c.post("/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
        got = c.post("/chat/completions", json={**chat, "return_tokens_as_token_ids": True}).json()
        content = got["choices"][0]["logprobs"]["content"]
        assert [e["logprob"] for e in content] == [e["logprob"] for e in text]
        for e in content:
            assert e["token"].startswith("token_id:") and e["bytes"] == list(e["token"].encode())
            assert all(t["token"].startswith("token_id:") for t in e["top_logprobs"])


def test_return_token_ids_gives_the_prompt_and_sampled_ids(real_server: Any) -> None:
    """vLLM's ``return_token_ids`` (agent-RL loops read the exact ids back instead of
    re-tokenizing text): ``prompt_token_ids`` and each choice's ``token_ids``; streamed, the
    prompt's in the first chunk and each chunk's new ids. It was ignored."""
    import json

    import httpx

    def streamed(c: httpx.Client, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        with c.stream("POST", route, json={**body, "stream": True}) as s:
            lines = [ln.removeprefix("data: ") for ln in s.iter_lines() if ln.startswith("data: {")]
        return [json.loads(ln) for ln in lines]

    with httpx.Client(base_url=real_server.url + "/v1", timeout=60) as c:
        body = {"prompt": [5, 9, 12, 7], "max_tokens": 5, "temperature": 0, "ignore_eos": True, "n": 2}
        assert "token_ids" not in c.post("/completions", json=body).json()["choices"][0]  # not asked for
        body["return_token_ids"] = True
        whole = c.post("/completions", json=body).json()["choices"]
        assert [ch["prompt_token_ids"] for ch in whole] == [[5, 9, 12, 7]] * 2
        assert all(len(ch["token_ids"]) == 5 for ch in whole)
        chunks = streamed(c, "/completions", body)
        for i in range(2):
            mine = [ch for k in chunks for ch in k["choices"] if ch["index"] == i]
            assert [ch.get("prompt_token_ids") for ch in mine][:1] == [[5, 9, 12, 7]]
            assert [t for ch in mine for t in ch["token_ids"]] == whole[i]["token_ids"]
        msgs = [{"role": "user", "content": "hi"}]
        chat = {
            "messages": msgs,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        got = c.post("/chat/completions", json=chat).json()
        base = real_server.url
        want_prompt = httpx.post(
            base + "/tokenize", json={"messages": msgs, "add_generation_prompt": True}
        ).json()
        assert got["prompt_token_ids"] == want_prompt["tokens"]
        ids = got["choices"][0]["token_ids"]
        assert len(ids) == 4
        chunks = streamed(c, "/chat/completions", chat)
        assert chunks[0]["prompt_token_ids"] == got["prompt_token_ids"]
        assert [t for k in chunks for ch in k["choices"] for t in ch.get("token_ids", [])] == ids
