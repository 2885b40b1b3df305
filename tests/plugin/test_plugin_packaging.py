"""CPU installs: lorastar imports, serves and generates without triton and peft (both optional)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]

BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("triton", "peft"):
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Block())
"""


def test_dependencies_keep_triton_and_peft_out_of_the_runtime() -> None:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [d.split(";")[0].split(">")[0].split("=")[0].strip() for d in meta["dependencies"]]
    assert "triton" not in names and "peft" not in names
    extras = meta["optional-dependencies"]
    assert any(d.startswith("triton") for d in extras["gpu"]) and any(
        d.startswith("triton") for d in extras["test"]
    )
    assert any(d.startswith("peft") for d in extras["test"])


def test_lorastar_never_imports_peft() -> None:
    for f in (REPO / "lorastar").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "peft" for a in node.names), f
            elif isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] != "peft", f


def test_generates_on_cpu_without_triton_or_peft(tiny_model_dir: Path) -> None:
    code = (
        BLOCKER
        + f"""
import lorastar, lorastar.plugin, lorastar.plugin.cli
from lorastar import LLM, SamplingParams
llm = LLM(model={str(tiny_model_dir)!r}, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16)
out = llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
assert len(out[0].outputs[0].token_ids) == 3
assert "triton" not in sys.modules and "peft" not in sys.modules
print("ok")
"""
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]
