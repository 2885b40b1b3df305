"""``keep_freed_memory``: big per-step buffers stop being page-faulted anew (engine/host_memory.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, torch
from lorastar.engine.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
for _ in range(10):  # the heap grows a few times (aligned allocations fragment it), then settles
    torch.empty(256, 49152).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.empty(256, 49152).fill_(1.0)  # 50 MB: a large batch's logits, made and freed per step
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_step_buffers_are_reused_instead_of_refaulted() -> None:
    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    pages = 10 * 256 * 49152 * 4 // 4096  # every page of ten fresh 50 MB buffers
    assert faults("default") > pages // 2  # glibc mmaps and unmaps each one
    assert faults("keep") < pages // 5  # kept in the heap and reused (at most ~2 late heap growths)


def test_tune_malloc_is_a_checked_option() -> None:
    from lorastar.config import EngineConfig

    assert EngineConfig().tune_malloc is True
    with pytest.raises(ValueError, match="tune_malloc"):
        EngineConfig(tune_malloc="yes")  # type: ignore[arg-type]
