"""Model and adapter references: a local folder, or a Hugging Face Hub id (``org/name``).

A hub id is fetched with ``huggingface_hub.snapshot_download`` (downloaded when the network allows,
taken from the local HF cache otherwise); offline and not cached, the error names the id and
``HF_HUB_OFFLINE``. Imports nothing from lorastar.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9]")
# Files a model or adapter folder needs (never the other weight formats a repo may carry).
_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]


def is_hub_id(ref: str) -> bool:
    """``org/name`` that is not an existing local path (local folders always win)."""
    return bool(_REPO_ID.fullmatch(ref)) and ".." not in ref and not Path(ref).expanduser().exists()


def snapshot_hub_id(ref: str | os.PathLike[str]) -> str | None:
    """The hub id of an HF cache snapshot folder (``models--{org}--{name}/snapshots/{commit}``)."""
    p = Path(ref)
    repo = p.parent.parent.name
    if p.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return None


def model_folder_name(ref: str | os.PathLike[str]) -> str:
    """The name a model is known by: its folder's name, the repo's name for an HF cache snapshot
    (``lorastar serve org/name`` hands the engine the snapshot: never the commit hash)."""
    return Path(snapshot_hub_id(ref) or ref).name


def adapter_hint(folder: str | os.PathLike[str]) -> str:
    """What to do instead, where ``folder`` given as a base model is a PEFT adapter ('' otherwise)."""
    if (Path(folder).expanduser() / "adapter_config.json").is_file():
        return " (it is a LoRA adapter: serve its base model and load it as an adapter, --lora-modules NAME=PATH)"
    return ""


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_folder(
    ref: str | os.PathLike[str],
    *,
    kind: str = "model",
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """The local folder for ``ref`` (a path, or a hub id fetched or found in the HF cache).
    ``revision``: a hub id's branch, tag or commit (vLLM's ``--revision``; ignored for a folder).
    ``cache_dir``: the folder hub ids download to and are found in instead of the HF cache (vLLM's
    ``--download-dir``)."""
    text = os.fspath(ref)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if not is_hub_id(text):
        raise ValueError(
            f"{kind} folder {text!r} does not exist (give a local folder or a Hugging Face id, org/name)"
        )
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as exc:  # pragma: no cover - transformers depends on huggingface_hub
        raise ValueError(f"{kind} {text!r}: loading Hugging Face ids needs huggingface_hub") from exc
    offline = _offline()
    try:
        pinned: dict[str, Any] = {"revision": revision} if revision else {}
        if cache_dir is not None:
            pinned["cache_dir"] = os.fspath(Path(cache_dir).expanduser())
        return Path(snapshot_download(text, allow_patterns=_PATTERNS, local_files_only=offline, **pinned))
    except LocalEntryNotFoundError as exc:
        why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face Hub cannot be reached"
        at = f" at revision {revision!r}" if revision else ""
        where = (
            f"the download folder {os.fspath(cache_dir)!r}"
            if cache_dir is not None
            else "the local Hugging Face cache"
        )
        raise ValueError(
            f"{kind} {text!r}{at} is not in {where} and {why}: download it where the "
            f"network allows (huggingface-cli download {text}){', or unset HF_HUB_OFFLINE' if offline else ''}, "
            "or give a local folder"
        ) from exc
    except (HfHubHTTPError, OSError) as exc:
        raise ValueError(f"{kind} {text!r}: cannot fetch it from the Hugging Face Hub ({exc})") from exc
