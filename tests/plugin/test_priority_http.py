"""vLLM's request ``priority`` over HTTP: served under ``--scheduling-policy priority`` on the
completions, chat and Responses routes (greedy tokens still HF's), a 400 naming ``priority`` on an
FCFS server (streamed or not) and for a value that is no int64, as vLLM answers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from litestar.testing import TestClient
from transformers import AutoModelForCausalLM

from lorastar.config import EngineConfig
from lorastar.plugin import LoraStarConfig, create_app
from tests.models.test_llama_vs_hf import hf_greedy, mixed_prompts

FAST = {"cpu_gemm": "torch", "cpu_kernels": "torch", "num_kv_blocks": 32, "max_model_len": 128}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> str:
    return str(tiny_model_dir)


def _app(model: str, policy: str) -> Any:
    return create_app(LoraStarConfig(engine=EngineConfig(model=model, scheduling_policy=policy, **FAST)))


def test_a_priority_server_serves_priorities(model: str) -> None:
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    prompt = mixed_prompts(5, [9])[0]
    ref = hf_greedy(hf, prompt, 6)
    with TestClient(_app(model, "priority")) as c:
        for prio in (-(2**63), -1, 7, 2**63 - 1):
            r = c.post(
                "/v1/completions",
                json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                      "return_token_ids": True, "priority": prio},
            )  # fmt: skip
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == ref
        r = c.post("/v1/chat/completions", json={**CHAT, "priority": 3})
        assert r.status_code == 200, r.text
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "priority": -2, "stream": True}) as s:
            assert s.status_code == 200 and "[DONE]" in "".join(s.iter_text())
        r = c.post("/v1/responses", json={"input": "hello", "max_output_tokens": 3, "priority": 1})
        assert r.status_code == 200, r.text


def test_an_fcfs_server_refuses_a_priority(model: str) -> None:
    with TestClient(_app(model, "fcfs")) as c:
        for route, body in (
            ("/v1/completions", {"prompt": "hello", "max_tokens": 3}),
            ("/v1/chat/completions", CHAT),
            ("/v1/responses", {"input": "hello", "max_output_tokens": 3}),
        ):
            for extra in ({}, {"stream": True}):
                r = c.post(route, json={**body, **extra, "priority": 1})
                assert r.status_code == 400, (route, r.text)
                err = r.json()["error"]
                assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"], err
            assert c.post(route, json={**body, "priority": 0}).status_code == 200
        for bad in ("high", 1.5, 2**63, -(2**63) - 1, True):
            r = c.post("/v1/chat/completions", json={**CHAT, "priority": bad})
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["param"] == "priority", r.text
        # the refused requests left nothing behind
        metrics = c.get("/metrics").text
        live = re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", metrics, re.M)
        assert live and all(float(v) == 0 for v in live), live
