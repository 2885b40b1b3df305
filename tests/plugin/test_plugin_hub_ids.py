"""Hugging Face ids for models and adapters, offline (HF_HUB_OFFLINE=1) against an HF cache laid out
by the test: found in the cache, or a clear error naming the id and HF_HUB_OFFLINE."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hub_cache_support import COMMIT, cache_repo

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hf_env(
    tiny_model_dir: Path, adapter_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    cache = tmp_path_factory.mktemp("hf") / "hub"
    cache_repo(cache, "testorg/tiny-llama", tiny_model_dir)
    cache_repo(cache, "testorg/alpha-lora", adapter_root / "alpha")
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    env.pop("HF_HOME", None)
    return env


def _py(code: str, env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    # cwd: an empty folder, so "testorg/..." is no local path
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


def test_model_and_adapter_ids_from_the_cache(hf_env: dict[str, str], tmp_path: Path) -> None:
    code = """
from lorastar import LLM, SamplingParams
llm = LLM(model="testorg/tiny-llama", device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16)
llm.load_adapter("alpha", "testorg/alpha-lora")
out = llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), adapter="alpha")
assert len(out[0].outputs[0].token_ids) == 3
print(llm.engine.model_name, llm.list_adapters()[0].path)
"""
    p = _py(code, hf_env, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    name, path = p.stdout.split()
    assert name == "tiny-llama" and path.endswith(f"models--testorg--alpha-lora/snapshots/{COMMIT}")


def test_missing_ids_offline_name_the_id_and_hf_hub_offline(hf_env: dict[str, str], tmp_path: Path) -> None:
    code = """
from lorastar import LLM
try:
    LLM(model="testorg/not-cached", device="cpu")
except ValueError as e:
    print(e)
"""
    p = _py(code, hf_env, tmp_path)
    assert "'testorg/not-cached'" in p.stdout and "HF_HUB_OFFLINE" in p.stdout, (p.stdout, p.stderr[-2000:])
    p = subprocess.run(
        [sys.executable, "-m", "lorastar.plugin.cli", "serve", "testorg/not-cached", "--port", "0"],
        cwd=tmp_path, env=hf_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "'testorg/not-cached'" in p.stderr and "HF_HUB_OFFLINE" in p.stderr
    p = subprocess.run(
        [sys.executable, "-m", "lorastar.plugin.cli", "serve", "--lora-modules", "x=testorg/nope", "--port", "0"],
        cwd=tmp_path, env=hf_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2 and "adapter 'x'" in p.stderr and "HF_HUB_OFFLINE" in p.stderr, p.stderr
