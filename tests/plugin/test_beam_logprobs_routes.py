"""``logprobs`` with ``use_beam_search`` on the HTTP routes, as vLLM serves them: each choice (a
hypothesis, best first) reports its tokens' logprobs, the same the offline engine gives
(``tests/engine/test_beam_logprobs.py`` checks those against HF transformers). They were a 400."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from plugin_support import engine_config

from lorastar import LLM, SamplingParams

PROMPT = [11, 22, 33, 44, 55, 66]


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path) -> Iterator[Any]:
    from litestar import Litestar
    from litestar.testing import TestClient

    from lorastar.plugin import LoraStarConfig, LoraStarPlugin

    plugin = LoraStarPlugin(LoraStarConfig(engine=engine_config(tiny_model_dir), served_model_name="tiny"))
    with TestClient(Litestar(plugins=[plugin])) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> Any:
    sp = SamplingParams(n=3, use_beam_search=True, temperature=0, max_tokens=6, logprobs=2)
    llm = LLM(config=engine_config(tiny_model_dir))
    return llm.generate([PROMPT], sp)[0]


def test_completions_beam_logprobs(client: Any, offline: Any) -> None:
    r = client.post("/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 6, "n": 3, "use_beam_search": True,
        "temperature": 0, "logprobs": 2, "return_tokens_as_token_ids": True,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 3
    for ch, ref in zip(choices, offline.outputs):
        lp = ch["logprobs"]
        assert [int(t.split(":")[1]) for t in lp["tokens"]] == ref.token_ids
        want = [e[t].logprob for t, e in zip(ref.token_ids, ref.logprobs)]
        assert lp["token_logprobs"] == pytest.approx(want, abs=1e-5)
        for top, e in zip(lp["top_logprobs"], ref.logprobs):
            assert 1 <= len(top) <= 3
            ranked = sorted(e.values(), key=lambda v: v.rank)[:2]
            for v in ranked:
                assert any(math.isclose(x, v.logprob, abs_tol=1e-5) for x in top.values())


def test_chat_beam_logprobs(client: Any) -> None:
    r = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 2,
        "use_beam_search": True, "logprobs": True, "top_logprobs": 2,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    for ch in body["choices"]:
        content = ch["logprobs"]["content"]
        assert content and len(content) <= 5
        assert "".join(c["token"] for c in content).startswith(ch["message"]["content"] or "")
        for c in content:
            assert math.isfinite(c["logprob"]) and c["logprob"] <= 0
            assert 1 <= len(c["top_logprobs"]) <= 2
            assert max(t["logprob"] for t in c["top_logprobs"]) >= c["logprob"] - 1e-6
    total = [sum(c["logprob"] for c in ch["logprobs"]["content"]) for ch in body["choices"]]
    assert len(total) == 2
