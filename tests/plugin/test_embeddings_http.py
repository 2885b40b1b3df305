"""``POST /v1/embeddings``: OpenAI's route (vLLM's extras) against HF transformers and PEFT, the
base model's or an adapter's, in-process and behind the engine-core process; base64 as OpenAI's
client asks for it; Matryoshka ``dimensions``; each bad input a 400 naming its field."""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from litestar.testing import TestClient

from lorastar.config import EngineConfig
from lorastar.plugin import LoraStarConfig, create_app

FAST = {"cpu_gemm": "torch", "cpu_kernels": "torch", "num_kv_blocks": 64, "max_model_len": 128}
TOL = 1e-4


def _hf_last(model_dir: Path, ids: list[int], adapter: Path | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).eval().base_model.model
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0, -1].float()


def _unit(v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(v, dim=0)


def _close(got: list[float], want: torch.Tensor) -> None:
    assert len(got) == want.shape[0]
    assert (torch.tensor(got) - want).abs().max().item() <= TOL


@pytest.fixture(scope="module", params=[False, True], ids=["engine-thread", "engine-process"])
def client(request: pytest.FixtureRequest, tiny_model_dir: Path, adapter_root: Path) -> Any:
    cfg = LoraStarConfig(
        engine=EngineConfig(model=str(tiny_model_dir), max_loras=2, **FAST),
        served_model_name="tiny",
        adapters={"alpha": str(adapter_root / "alpha")},
        engine_process=request.param,
    )
    with TestClient(create_app(cfg)) as c:
        yield c


def test_embeddings_equal_transformers_and_peft(
    client: Any, tiny_model_dir: Path, adapter_root: Path
) -> None:
    tok = client.app.plugins.get("LoraStarPlugin").service.engine.tokenizer
    texts = ["hello there, how are you", "x"]
    ids = [list(tok(t)["input_ids"]) for t in texts]
    r = client.post("/v1/embeddings", json={"input": texts, "model": "tiny"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "tiny" and body["id"].startswith("embd-")
    assert [d["index"] for d in body["data"]] == [0, 1] and all(
        d["object"] == "embedding" for d in body["data"]
    )
    for d, i in zip(body["data"], ids):
        _close(d["embedding"], _unit(_hf_last(tiny_model_dir, i)))
    usage = body["usage"]
    assert (
        usage["prompt_tokens"] == usage["total_tokens"] == sum(map(len, ids))
        and usage["completion_tokens"] == 0
    )
    # an adapter's, from token ids (one list, then a list of lists), raw
    r = client.post("/v1/embeddings", json={"input": ids[0], "model": "alpha", "normalize": False})
    want = _hf_last(tiny_model_dir, ids[0], adapter_root / "alpha")
    _close(r.json()["data"][0]["embedding"], want)
    assert (want - _hf_last(tiny_model_dir, ids[0])).abs().max() > 1e-3  # the adapter changes it
    r = client.post("/v1/embeddings", json={"input": [ids[1], ids[0]], "model": "alpha"})
    _close(r.json()["data"][1]["embedding"], _unit(want))


def test_base64_and_dimensions(client: Any) -> None:
    floats = client.post("/v1/embeddings", json={"input": "hello there"}).json()["data"][0]["embedding"]
    b64 = client.post("/v1/embeddings", json={"input": "hello there", "encoding_format": "base64"}).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert struct.unpack(f"<{len(raw) // 4}f", raw) == pytest.approx(floats, abs=1e-6)
    r = client.post("/v1/embeddings", json={"input": "hello there", "dimensions": 8, "normalize": True})
    short = r.json()["data"][0]["embedding"]
    assert len(short) == 8
    _close(short, _unit(torch.tensor(floats[:8])))  # Matryoshka: the first 8, normalized again


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"input": ""}, "input", 400),
        ({"input": []}, "input", 400),
        ({"input": [1, -2]}, "input", 400),
        ({"input": [[1], "a"]}, "input", 400),
        ({"input": "hi " * 200}, "input", 400),
        ({"input": "hi", "dimensions": 0}, "dimensions", 400),
        ({"input": "hi", "dimensions": 100000}, "dimensions", 400),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", 400),
        ({"input": "hi", "truncate_prompt_tokens": 1000}, "truncate_prompt_tokens", 400),
        ({"input": "hi", "model": "nope"}, "model", 404),
    ],
)
def test_bad_input_is_a_clear_error(client: Any, body: dict[str, Any], param: str, status: int) -> None:
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_truncation_and_nothing_leaks(client: Any, tiny_model_dir: Path) -> None:
    tok = client.app.plugins.get("LoraStarPlugin").service.engine.tokenizer
    text = "hi " * 200
    r = client.post("/v1/embeddings", json={"input": text, "truncate_prompt_tokens": 20})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 20
    _close(
        r.json()["data"][0]["embedding"], _unit(_hf_last(tiny_model_dir, list(tok(text)["input_ids"])[-20:]))
    )
    stats = client.get("/lorastar/stats").json()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_openai_client(real_server: Any, offline_llm: Any) -> None:
    """OpenAI's Python client (base64 by default, decoded by the client) against the live server."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="x", max_retries=0)
    got = client.embeddings.create(model="alpha", input=["The capital of France is", "hi"])
    want = offline_llm.embed(["The capital of France is", "hi"], adapter="alpha")
    for d, w in zip(got.data, want):
        assert d.embedding == pytest.approx(w.outputs.embedding, abs=1e-5)
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)


def test_sagemaker_invocations_and_load_count_embeddings(tiny_model_dir: Path) -> None:
    """vLLM's /invocations hands a body with ``input`` to the embeddings route; /load counts it."""
    cfg = LoraStarConfig(
        engine=EngineConfig(model=str(tiny_model_dir), **FAST),
        sagemaker_routes=True,
        enable_server_load_tracking=True,
    )
    with TestClient(create_app(cfg)) as c:
        body = {"input": ["hello", "there"]}
        direct, via = c.post("/v1/embeddings", json=body), c.post("/invocations", json=body)
        assert via.status_code == direct.status_code == 200, via.text
        assert via.json()["data"] == direct.json()["data"]
        assert c.get("/load").json() == {"server_load": 0}


def test_run_batch_embeds(tiny_model_dir: Path, adapter_root: Path, tmp_path: Path) -> None:
    """vLLM's run-batch takes /v1/embeddings lines: the base's and an adapter's, as HF and PEFT."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    batch = [
        {"custom_id": "base", "url": "/v1/embeddings", "body": {"model": "tiny", "input": ["hello", "x y"]}},
        {
            "custom_id": "alpha",
            "url": "/v1/embeddings",
            "body": {"model": "alpha", "input": "hello", "normalize": False},
        },
        {"custom_id": "bad", "url": "/v1/embeddings", "body": {"model": "tiny", "input": ""}},
    ]
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "lorastar.plugin.cli", "run-batch", "-i", "-", "-o", str(out), str(tiny_model_dir),
         "--served-model-name", "tiny", "--lora-modules", f"alpha={adapter_root / 'alpha'}", "--device", "cpu",
         "--no-engine-process", "--disable-log-stats"],
        input="".join(json.dumps({**b, "method": "POST"}) + "\n" for b in batch),
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    base = records["base"]["response"]["body"]["data"]
    for d, text in zip(base, ["hello", "x y"]):
        _close(d["embedding"], _unit(_hf_last(tiny_model_dir, list(tok(text)["input_ids"]))))
    ids = list(tok("hello")["input_ids"])
    _close(
        records["alpha"]["response"]["body"]["data"][0]["embedding"],
        _hf_last(tiny_model_dir, ids, adapter_root / "alpha"),
    )
    assert (
        records["bad"]["response"]["status_code"] == 400
        and records["bad"]["error"]["error"]["param"] == "input"
    )


def test_more_inputs_than_the_queue_takes_is_a_400(tiny_model_dir: Path) -> None:
    cfg = LoraStarConfig(engine=EngineConfig(model=str(tiny_model_dir), **FAST), max_waiting=2)
    with TestClient(create_app(cfg)) as c:
        r = c.post("/v1/embeddings", json={"input": ["a", "b", "c"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
        assert "3 inputs" in r.json()["error"]["message"] and "max_waiting" in r.json()["error"]["message"]
        assert c.post("/v1/embeddings", json={"input": ["a", "b"]}).status_code == 200
