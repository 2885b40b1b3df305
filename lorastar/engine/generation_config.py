"""The model creator's sampling defaults from ``generation_config.json`` (vLLM's
``--generation-config auto``, its default since v0.7).

A request that leaves ``temperature``, ``top_p``, ``top_k``, ``min_p`` or ``repetition_penalty``
unset gets the model's recommended value (Qwen3: 0.6 / 0.95 / 20; Llama 3.1: 0.6 / 0.9), not
OpenAI's neutral one; ``max_new_tokens`` caps ``max_tokens``. As in vLLM, only values that differ
from transformers' own ``GenerationConfig`` defaults count (a file that spells out ``top_k: 50``
sets nothing), and ``do_sample`` is not read. ``"vllm"`` turns this off; a folder reads its file.
``override_generation_config`` sets values over the file's (or, with ``"vllm"``, alone).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# transformers' GenerationConfig defaults (what its to_diff_dict leaves out)
_HF_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def generation_defaults(
    model_dir: Path, setting: str = "auto", override: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The sampling defaults ``setting`` names: ``"auto"`` (``model_dir``'s
    ``generation_config.json``), ``"vllm"`` (none) or a folder holding one, with ``override``'s
    values over them (vLLM's ``--override-generation-config``). Keys are ``SamplingParams`` fields
    (``max_new_tokens`` becomes ``max_tokens``); a value of the wrong type is a ``ValueError``
    naming the file or the override."""
    out = _from_file(model_dir, setting)
    if override:
        out.update(check_override(override))
    return out


def defaults_source(setting: str, override: dict[str, Any] | None) -> str:
    """Where the defaults came from, for the start-up lines."""
    if not override:
        return "generation_config.json"
    return (
        "override_generation_config"
        if setting == "vllm"
        else "generation_config.json and override_generation_config"
    )


def check_override(override: dict[str, Any]) -> dict[str, Any]:
    """``override`` as ``SamplingParams`` fields, each key one of ``generation_config.json``'s and
    each value in its ``SamplingParams`` range (so that no request is refused for a default); a
    ``ValueError`` naming the key otherwise."""
    from lorastar.engine.sampling import SamplingParams

    where = "override_generation_config"
    if not isinstance(override, dict):
        raise ValueError(f'{where} must be a JSON object such as {{"temperature": 0.6}}, got {override!r}')
    out: dict[str, Any] = {}
    for name, value in override.items():
        if name not in _FIELDS:
            raise ValueError(f"{where}: {name!r} is not one of {', '.join(_FIELDS)}")
        _check(name, value, where)
        out["max_tokens" if name == "max_new_tokens" else name] = value
    try:
        SamplingParams(**out)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return out


def _check(name: str, value: Any, where: str) -> None:
    integer = name in ("top_k", "max_new_tokens")
    ok = isinstance(value, int) if integer else isinstance(value, int | float) and math.isfinite(value)
    if isinstance(value, bool) or not ok or (name == "max_new_tokens" and value < 1):
        raise ValueError(f"generation_config: {name}={value!r} in {where} is not a valid number")


def _from_file(model_dir: Path, setting: str) -> dict[str, Any]:
    if setting == "vllm":
        return {}
    path = (model_dir if setting == "auto" else Path(setting).expanduser()) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"generation_config: cannot read {path}: {exc}") from exc
    out: dict[str, Any] = {}
    for name in _FIELDS if isinstance(cfg, dict) else ():
        value = cfg.get(name)
        if value is None or value == _HF_DEFAULTS.get(name, object()):
            continue
        _check(name, value, str(path))
        out["max_tokens" if name == "max_new_tokens" else name] = value
    return out
