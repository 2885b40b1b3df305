"""Every ```bash block of README.md and lorastar/plugin/README.md runs as written (port substituted)
against the live servers it starts, so the documented commands cannot drift from the CLI."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_support import free_port

REPO = Path(__file__).resolve().parents[2]
READMES = [REPO / "README.md", REPO / "lorastar" / "plugin" / "README.md"]
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)


def bash_blocks() -> list[tuple[str, int, str]]:
    out = []
    for path in READMES:
        for i, m in enumerate(BLOCK.finditer(path.read_text())):
            out.append((str(path.relative_to(REPO)), i, m.group(1)))
    return out


BLOCKS = bash_blocks()


def test_readmes_have_cli_blocks() -> None:
    scripts = "\n".join(b for _, _, b in BLOCKS)
    assert "lora list" in scripts and "lora load" in scripts and "lorastar serve" in scripts


@pytest.mark.parametrize(("readme", "index", "script"), BLOCKS, ids=[f"{r}#{i}" for r, i, _ in BLOCKS])
def test_readme_bash_block_runs(readme: str, index: int, script: str) -> None:
    if re.search(r"^make ", script, re.M):
        # `make test` would run this suite again: check the targets exist (dry run) instead.
        script = re.sub(r"^make ", "make -n ", script, flags=re.M)
    port = str(free_port())
    script = script.replace("8000", port)
    bindir = str(Path(sys.executable).parent)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        PATH=bindir + os.pathsep + os.environ.get("PATH", ""),
    )
    env.pop("LORASTAR_ADMIN_TOKEN", None)
    env.pop("LORASTAR_URL", None)
    proc = subprocess.Popen(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # servers left behind by a failed block
        except ProcessLookupError:
            pass
    text = out.decode(errors="replace")
    assert proc.returncode == 0, f"{readme} block {index} failed (rc {proc.returncode}):\n{text[-4000:]}"
    if "lora load" in script:
        assert "added successfully" in text and "removed successfully" in text, text[-4000:]
    if "lora list" in script:
        assert "base model:" in text, text[-4000:]
