"""The model creator's sampling defaults (review): vLLM reads ``generation_config.json``
(``--generation-config auto``, its default) and applies its temperature, top_p, top_k, min_p and
repetition_penalty to requests that leave them unset, with ``max_new_tokens`` capping
``max_tokens``. lorastar ignored the file: a Qwen3 fine-tune sampled at temperature 1.0 with no
top_k where vLLM samples at 0.6 / 0.95 / 20."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from lorastar.config import EngineConfig
from lorastar.engine.core_client import AsyncCoreClient
from lorastar.engine.generation_config import generation_defaults
from lorastar.engine.llm import LLM
from lorastar.engine.sampling import SamplingParams
from lorastar.plugin import LoraStarConfig, create_app

FAST = {"cpu_gemm": "torch", "cpu_kernels": "torch", "num_kv_blocks": 32}
# greedy and 5 tokens unless a request says otherwise (temperature 0 keeps the tests exact)
GENERATION = {
    "temperature": 0.0,
    "max_new_tokens": 5,
    "top_k": 50,
    "repetition_penalty": 1.0,
    "do_sample": True,
}


def _with_generation_config(src: str, dst: Path, generation: dict[str, Any]) -> str:
    dst.mkdir()
    for f in Path(src).iterdir():
        if f.name != "generation_config.json":
            (dst / f.name).symlink_to(f)
    base = json.loads((Path(src) / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**base, **generation}))
    return str(dst)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    return _with_generation_config(
        tiny_model_dir("llama-gqa"), tmp_path_factory.mktemp("gen") / "m", GENERATION
    )


def test_the_defaults_are_what_vllm_reads(tmp_path: Path) -> None:
    qwen3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "bos_token_id": 1}
    folder = Path(_with_generation_config_file(tmp_path / "q", qwen3))
    assert generation_defaults(folder) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert generation_defaults(folder, "vllm") == {}
    # values equal to transformers' own defaults set nothing (vLLM reads GenerationConfig's diff)
    plain = Path(_with_generation_config_file(tmp_path / "p", {"top_k": 50, "temperature": 1.0}))
    assert generation_defaults(tmp_path / "none") == {} and generation_defaults(plain) == {}
    assert generation_defaults(tmp_path, str(folder)) == generation_defaults(folder)  # a folder of its own
    bad = Path(_with_generation_config_file(tmp_path / "b", {"top_k": "20"}))
    with pytest.raises(ValueError, match="top_k"):
        generation_defaults(bad)
    with pytest.raises(ValueError, match="generation_config must be"):
        EngineConfig(generation_config=str(tmp_path / "missing"))


def _with_generation_config_file(folder: Path, cfg: dict[str, Any]) -> str:
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(cfg))
    return str(folder)


def test_offline_generate_without_params_uses_them(model: str) -> None:
    llm = LLM(model, **FAST)
    prompt = [[5, 9, 12, 7, 3]]
    default = llm.generate(prompt)[0].outputs[0]
    want = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert default.token_ids == want.token_ids and len(default.token_ids) == 5
    assert llm.get_default_sampling_params().temperature == 0.0
    neutral = LLM(model, generation_config="vllm", **FAST)
    assert len(neutral.generate(prompt, SamplingParams(ignore_eos=True))[0].outputs[0].token_ids) == 16


def test_http_requests_get_them_where_unset(model: str) -> None:
    with TestClient(create_app(LoraStarConfig(engine=EngineConfig(model=model, **FAST)))) as c:
        msgs = [{"role": "user", "content": "hello"}]
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 50, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 5  # max_new_tokens caps a larger max_tokens
        again = c.post("/v1/chat/completions", json={"messages": msgs, "temperature": 0, "max_tokens": 5})
        assert again.json()["choices"][0]["message"] == body["choices"][0]["message"]  # greedy
        r = c.post("/v1/completions", json={"prompt": "hello", "ignore_eos": True})  # default 16, capped
        assert r.json()["usage"]["completion_tokens"] == 5
        # a request's own value wins: sampled at temperature 1 with a seed, n=4 differ somewhere
        r = c.post(
            "/v1/completions",
            json={"prompt": "hello", "ignore_eos": True, "temperature": 1.0, "seed": 3, "n": 4},
        )
        texts = {ch["text"] for ch in r.json()["choices"]}
        assert len(texts) > 1


def test_a_core_process_hands_them_to_its_frontend(model: str, tmp_path: Path, core_in_thread: Any) -> None:
    address = f"ipc://{tmp_path}/core"

    async def main() -> dict[str, Any]:
        client = await asyncio.to_thread(AsyncCoreClient, address=address, start_timeout=60)
        try:
            return client.default_sampling
        finally:
            await client.shutdown(drain_timeout=0)

    with core_in_thread(EngineConfig(model=model, device="cpu", dtype="float32", **FAST), address):
        assert asyncio.run(main()) == {"temperature": 0.0, "max_tokens": 5}
