"""Helpers for the quant tests: the committed fixtures made by scripts/make_quant_fixtures.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quant"
INT4_NAMES = ("awq_g32", "awq_g128", "gptq_sym", "gptq_asym", "gptq_act", "gptq_8bit")
FP8_NAMES = ("fp8_tensor", "fp8_channel")
# compressed-tensors pack-quantized int weight-only (llm-compressor), served through the GPTQ path.
CT_INT_NAMES = ("w4a16_g32", "w4a16_asym", "w8a16")
ALL_NAMES = INT4_NAMES + FP8_NAMES


def fixture_dir(name: str) -> Path:
    return FIXTURES / name


def have_fixture(name: str) -> bool:
    d = fixture_dir(name)
    return (d / "config.json").is_file() and (d / "reference" / "reference.safetensors").is_file()


def present(names: tuple[str, ...]) -> list[str]:
    """Fixtures present in the repo (the script may not have been able to make every one)."""
    return [n for n in names if have_fixture(n)]


def read_config(name: str) -> dict[str, Any]:
    return json.loads((fixture_dir(name) / "config.json").read_text())


def read_tensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}


def checkpoint(name: str, prefix: str = "") -> dict[str, torch.Tensor]:
    return read_tensors(fixture_dir(name) / "model.safetensors", prefix)


def reference(name: str) -> dict[str, torch.Tensor]:
    return read_tensors(fixture_dir(name) / "reference" / "reference.safetensors")
