"""A Hugging Face cache written by hand, and a process cut off from the network: the hub-id tests'
shared setup (no test reaches the Hub)."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import constants

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(
    cache: Path,
    repo_id: str,
    src: Path,
    names: tuple[str, ...] | None = None,
    *,
    commit: str = COMMIT,
    refs: tuple[str, ...] = ("main",),
) -> Path:
    """Lay ``src`` (all of it, or the files in ``names``) out as huggingface_hub does, as snapshot
    ``commit`` with each of ``refs`` pointing at it: models--org--name/{refs/*, snapshots/<commit>/}.
    Call again with another commit to add a snapshot. Returns the snapshot folder."""
    base = cache / ("models--" + repo_id.replace("/", "--"))
    (base / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (base / "refs" / ref).write_text(commit)
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in src.iterdir():
        if names is None or f.name in names:
            (shutil.copytree if f.is_dir() else shutil.copy)(f, snap / f.name)
    return snap


def go_offline(cache: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point this process at ``cache`` with HF_HUB_OFFLINE=1, run it from ``workdir`` (so an id is no
    local path) and make any network call an error."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # read by huggingface_hub at import
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(workdir)

    def no_network(*a: Any, **k: Any) -> Any:
        raise AssertionError(f"network call in offline mode: {a}")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
