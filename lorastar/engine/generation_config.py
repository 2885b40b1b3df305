"""The model creator's sampling defaults from ``generation_config.json`` (vLLM's
``--generation-config auto``, its default since v0.7).

A request that leaves ``temperature``, ``top_p``, ``top_k``, ``min_p`` or ``repetition_penalty``
unset gets the model's recommended value (Qwen3: 0.6 / 0.95 / 20; Llama 3.1: 0.6 / 0.9), not
OpenAI's neutral one; ``max_new_tokens`` caps ``max_tokens``. As in vLLM, only values that differ
from transformers' own ``GenerationConfig`` defaults count (a file that spells out ``top_k: 50``
sets nothing), and ``do_sample`` is not read. ``"vllm"`` turns this off; a folder reads its file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# transformers' GenerationConfig defaults (what its to_diff_dict leaves out)
_HF_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def generation_defaults(model_dir: Path, setting: str = "auto") -> dict[str, Any]:
    """The sampling defaults ``setting`` names: ``"auto"`` (``model_dir``'s
    ``generation_config.json``), ``"vllm"`` (none) or a folder holding one. Keys are
    ``SamplingParams`` fields (``max_new_tokens`` becomes ``max_tokens``); a value of the wrong
    type is a ``ValueError`` naming the file."""
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
        integer = name in ("top_k", "max_new_tokens")
        ok = isinstance(value, int) if integer else isinstance(value, int | float) and math.isfinite(value)
        if isinstance(value, bool) or not ok or (name == "max_new_tokens" and value < 1):
            raise ValueError(f"generation_config: {name}={value!r} in {path} is not a valid number")
        out["max_tokens" if name == "max_new_tokens" else name] = value
    return out
