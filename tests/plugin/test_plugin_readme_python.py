"""README.md: the Python API snippets run as written, and every benchmark plot is shown inline."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
API_BLOCKS = [
    b
    for b in re.findall(r"^```python\n(.*?)^```", README, re.M | re.S)
    if "from lorastar import LLM" in b or "AsyncLLM" in b
]


def test_benchmark_plots_are_inline() -> None:
    pngs = sorted(p.name for p in (REPO / "benchmarks" / "results").glob("*.png"))
    assert pngs
    shown = re.findall(r"!\[[^\]]*\]\(benchmarks/results/([^)]+\.png)\)", README)
    assert sorted(shown) == pngs


@pytest.mark.parametrize("block", API_BLOCKS, ids=[f"api{i}" for i in range(len(API_BLOCKS))])
def test_python_api_snippet_runs(block: str) -> None:
    assert len(API_BLOCKS) == 2
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run(
        [sys.executable, "-c", block], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip(), p.stderr[-3000:]
