"""Hugging Face ids against vLLM: the base of ``lorastar serve org/name`` answers to ``model="org/name"``
(vLLM's served name), a tokenizer given as an id is fetched as the model is (the CLI refused it, the
engine never downloaded it), and an id missing online does not tell to unset an ``HF_HUB_OFFLINE``
that is not set. No network: an HF cache written by hand, and ``snapshot_download`` replaced."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
from hub_cache_support import COMMIT, cache_repo, go_offline
from plugin_fake_engine import FakeAsyncLLM
from plugin_support import engine_config

from lorastar.plugin import LoraStarConfig
from lorastar.plugin.errors import APIError
from lorastar.plugin.service import LoraStarService

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF cache, HF_HUB_OFFLINE=1, cwd an empty folder, and any network call an error."""
    cache = tmp_path / "hub"
    cache.mkdir()
    work = tmp_path / "cwd"
    work.mkdir()
    go_offline(cache, work, monkeypatch)
    return cache


def test_the_base_answers_to_its_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM serves ``vllm serve org/name`` as ``org/name`` (served_model_name defaults to the model
    argument): its clients send ``model="org/name"``, which was a 404 here (the base is ``name``)."""
    monkeypatch.chdir(tmp_path)  # "testorg/tiny-llama" is no local folder
    snap = tmp_path / "hf" / "models--testorg--tiny-llama" / "snapshots" / COMMIT
    snap.mkdir(parents=True)

    async def resolve(cfg: LoraStarConfig, model: str) -> str | None:
        return await LoraStarService(cfg).resolve_model(model)

    for model in (str(snap), "testorg/tiny-llama"):  # lorastar serve's snapshot, or the id itself
        cfg = LoraStarConfig(model=model, async_engine=FakeAsyncLLM())
        assert asyncio.run(resolve(cfg, "testorg/tiny-llama")) is None, model
        with pytest.raises(APIError) as e:  # another repo's id is still unknown
            asyncio.run(resolve(cfg, "testorg/other"))
        assert e.value.status_code == 404
    # A served_model_name given replaces the default name: the id is not served then (vLLM's).
    cfg = LoraStarConfig(model=str(snap), served_model_name="tiny", async_engine=FakeAsyncLLM())
    with pytest.raises(APIError) as e:
        asyncio.run(resolve(cfg, "testorg/tiny-llama"))
    assert e.value.status_code == 404


def test_serve_takes_a_tokenizer_hub_id_from_the_cache_offline(
    offline_cache: Path, tiny_model_dir: Path
) -> None:
    """``lorastar serve M --tokenizer org/tok`` (vLLM's --tokenizer takes an id): was "--tokenizer
    folder 'org/tok' does not exist"; now the cached snapshot, with no network call."""
    from lorastar.plugin.cli import UsageProblem
    from lorastar.plugin.cli import engine_config as cli_engine_config

    snap = cache_repo(offline_cache, "testorg/tok", tiny_model_dir, TOKENIZER_FILES)
    cfg = cli_engine_config(tokenizer="testorg/tok", chat_template=None, max_cpu_loras=None, max_loras=1)
    assert cfg.tokenizer == str(snap)
    with pytest.raises(UsageProblem) as e:  # not cached: one line naming the id and HF_HUB_OFFLINE
        cli_engine_config(tokenizer="testorg/nope", chat_template=None, max_cpu_loras=None, max_loras=1)
    msg = str(e.value.message)
    assert "--tokenizer" in msg and "'testorg/nope'" in msg and "HF_HUB_OFFLINE" in msg
    with pytest.raises(UsageProblem, match="--tokenizer folder"):  # no id: a missing folder, as before
        cli_engine_config(tokenizer="./no/tok", chat_template=None, max_cpu_loras=None, max_loras=1)


def test_the_engine_fetches_a_tokenizer_hub_id(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``LLM(model=..., tokenizer="org/tok")`` online: the id was handed to transformers with
    ``local_files_only=True``, so a tokenizer not cached yet was never downloaded (an error)."""
    from lorastar import LLM

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    for name in TOKENIZER_FILES:
        if (tiny_model_dir / name).is_file():
            shutil.copy(tiny_model_dir / name, downloaded / name)
    calls: list[tuple[str, bool]] = []

    def fake_download(repo_id: str, *, allow_patterns: Any = None, local_files_only: bool = False) -> str:
        calls.append((repo_id, local_files_only))
        return str(downloaded)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    llm = LLM(config=engine_config(tiny_model_dir, tokenizer="testorg/tok", num_kv_blocks=16, max_num_seqs=2))
    assert calls == [("testorg/tok", False)]
    assert llm.engine.tokenizer_dir == downloaded and llm.get_tokenizer().encode("Hello")


def test_missing_online_does_not_say_unset_hf_hub_offline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Not cached and the Hub unreachable, HF_HUB_OFFLINE unset: the error told to unset it."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    from lorastar.hub import resolve_folder

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def unreachable(repo_id: str, **kw: Any) -> str:
        raise LocalEntryNotFoundError("cannot reach the Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ValueError) as e:
        resolve_folder("testorg/nope", kind="adapter")
    msg = str(e.value)
    assert "adapter 'testorg/nope'" in msg and "cannot be reached" in msg and "HF_HUB_OFFLINE" not in msg
