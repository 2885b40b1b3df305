"""vLLM's ``--revision``: a model given as a Hugging Face id loads the branch, tag or commit asked for
(production servers pin one); without it, the default branch. There was no way to pin one. No
network: an HF cache written by hand with two snapshots, HF_HUB_OFFLINE=1 and sockets refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hub_cache_support import cache_repo, go_offline

from lorastar.hub import resolve_folder

MAIN = "0" * 40
PINNED = "1" * 40
REPO = "testorg/tiny"


@pytest.fixture
def cache(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``testorg/tiny`` with ``main`` at one commit and tag ``v1`` at another (the tiny model, its
    ``config.json`` marked with the commit)."""
    root = tmp_path / "hub"
    for commit, ref in ((MAIN, "main"), (PINNED, "v1")):
        snap = cache_repo(root, REPO, tiny_model_dir, commit=commit, refs=(ref,))
        cfg = json.loads((snap / "config.json").read_text())
        (snap / "config.json").write_text(json.dumps({**cfg, "_commit": commit}))
    go_offline(root, tmp_path, monkeypatch)
    return root


def test_revision_picks_the_snapshot(cache: Path) -> None:
    assert resolve_folder(REPO).name == MAIN
    assert resolve_folder(REPO, revision="v1").name == PINNED
    assert resolve_folder(REPO, revision=PINNED).name == PINNED
    with pytest.raises(ValueError, match="at revision 'v2'"):
        resolve_folder(REPO, revision="v2")


def test_engine_and_serve_take_the_revision(cache: Path) -> None:
    from click.testing import CliRunner

    from lorastar import LLM
    from lorastar.plugin import cli

    kw: dict[str, Any] = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 16, "max_model_len": 64}
    assert LLM(REPO, revision="v1", **kw).engine.model_dir.name == PINNED
    assert LLM(REPO, **kw).engine.model_dir.name == MAIN
    # the CLI resolves the model before anything loads: an unknown revision is a one-line usage error
    res = CliRunner().invoke(cli.main, ["serve", REPO, "--revision", "v2", "--port", "1"])
    assert res.exit_code == 2 and "at revision 'v2'" in res.output and "Traceback" not in res.output
    assert cli._check_model(REPO, "v1") == str(cache / "models--testorg--tiny" / "snapshots" / PINNED)


def test_tokenizer_revision_picks_the_tokenizer_snapshot(cache: Path, tiny_model_dir: Path) -> None:
    """vLLM's ``--tokenizer-revision``: a tokenizer given as a Hub id loads at the revision asked for
    (the model's ``--revision`` does not apply to it), in-process and from the CLI."""
    from hub_cache_support import cache_repo

    from lorastar import LLM
    from lorastar.plugin.cli import UsageProblem, engine_config

    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    for commit, ref in ((MAIN, "main"), (PINNED, "v1")):
        cache_repo(cache, "testorg/tok", tiny_model_dir, names, commit=commit, refs=(ref,))
    kw: dict[str, Any] = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 16, "max_model_len": 64}
    snaps = cache / "models--testorg--tok" / "snapshots"
    for rev, want in ((None, MAIN), ("v1", PINNED)):
        eng = LLM(REPO, tokenizer="testorg/tok", tokenizer_revision=rev, revision="v1", **kw).engine
        assert eng.model_dir.name == PINNED
        assert eng.tokenizer_dir == snaps / want
        cfg = engine_config(
            tokenizer="testorg/tok",
            tokenizer_revision=rev,
            chat_template=None,
            max_cpu_loras=None,
            max_loras=1,
        )
        assert cfg.tokenizer == str(snaps / want) and cfg.tokenizer_revision == rev
    with pytest.raises(UsageProblem, match="at revision 'v2'"):
        engine_config(
            tokenizer="testorg/tok",
            tokenizer_revision="v2",
            chat_template=None,
            max_cpu_loras=None,
            max_loras=1,
        )
