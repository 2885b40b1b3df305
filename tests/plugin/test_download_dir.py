"""``download_dir`` / ``--download-dir`` (vLLM's): Hugging Face ids of the model, tokenizer and
adapters are found in (and would download to) that folder instead of the HF cache; offline here,
against caches laid out by the test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hub_cache_support import COMMIT, cache_repo

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dirs(
    tiny_model_dir: Path, adapter_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """``download``: the model, its tokenizer and an adapter as huggingface_hub lays them out;
    ``empty``: the HF cache of the process, holding nothing."""
    download = tmp_path_factory.mktemp("volume") / "models"
    cache_repo(download, "testorg/tiny-llama", tiny_model_dir)
    cache_repo(download, "testorg/alpha-lora", adapter_root / "alpha")
    empty = tmp_path_factory.mktemp("hf") / "hub"
    empty.mkdir()
    return {"download": download, "empty": empty}


def run(args: list[str], dirs: dict[str, Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_CACHE=str(dirs["empty"]), HF_HUB_OFFLINE="1")
    env.pop("HF_HOME", None)
    # cwd: an empty folder, so "testorg/..." is no local path
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_ids_are_found_in_the_download_dir(dirs: dict[str, Path], tmp_path: Path) -> None:
    code = f"""
from lorastar import LLM, SamplingParams
llm = LLM(model="testorg/tiny-llama", tokenizer="testorg/tiny-llama", download_dir={str(dirs["download"])!r},
          device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16)
llm.load_adapter("alpha", "testorg/alpha-lora")
out = llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), adapter="alpha")
assert len(out[0].outputs[0].token_ids) == 3
print(llm.engine.model_dir, llm.list_adapters()[0].path)
try:
    LLM(model="testorg/tiny-llama", device="cpu")  # the HF cache alone: not there
except ValueError as e:
    print("REFUSED", e)
"""
    p = run(["-c", code], dirs, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    first, refused = p.stdout.strip().split("\n")
    model_dir, adapter = first.split()
    assert model_dir == str(dirs["download"] / "models--testorg--tiny-llama" / "snapshots" / COMMIT)
    assert adapter == str(dirs["download"] / "models--testorg--alpha-lora" / "snapshots" / COMMIT)
    assert "'testorg/tiny-llama' is not in the local Hugging Face cache" in refused


def test_serve_checks_ids_in_the_download_dir_before_loading(dirs: dict[str, Path], tmp_path: Path) -> None:
    """A missing id is named with the folder it was looked for in; the serve command resolves the
    model and adapters there (the port check comes after: port 1 is refused once they are found)."""
    missing = run(
        [
            "-m",
            "lorastar.plugin.cli",
            "serve",
            "testorg/nope",
            "--download-dir",
            str(dirs["download"]),
            "--port",
            "0",
        ],
        dirs,
        tmp_path,
    )
    assert missing.returncode == 2, missing.stderr
    assert f"'testorg/nope' is not in the download folder '{dirs['download']}'" in missing.stderr
    found = run(
        ["-m", "lorastar.plugin.cli", "serve", "testorg/tiny-llama", "--lora-modules", "a=testorg/alpha-lora",
         "--download-dir", str(dirs["download"]), "--host", "256.0.0.1", "--port", "1"],
        dirs, tmp_path,
    )  # fmt: skip
    assert found.returncode == 2 and "cannot listen on 256.0.0.1:1" in found.stderr, found.stderr
    without = run(["-m", "lorastar.plugin.cli", "serve", "testorg/tiny-llama", "--port", "0"], dirs, tmp_path)
    assert without.returncode == 2 and "HF_HUB_OFFLINE" in without.stderr, without.stderr


def test_a_download_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    from lorastar.config import EngineConfig

    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        EngineConfig(download_dir=str(tmp_path / "f"))
    assert EngineConfig(download_dir=tmp_path / "new").download_dir == str(tmp_path / "new")  # type: ignore[arg-type]
