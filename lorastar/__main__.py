"""The ``lorastar`` command (``python -m lorastar``): the OpenMP wait policy of a server process is
set here, before torch loads libgomp, then the click group runs (``plugin/cli.py``).

``lorastar serve`` and ``lorastar engine`` get ``GOMP_SPINCOUNT=3000``: a worker thread spins about
that many rounds for the next parallel region before it sleeps, instead of none under the
library's default ``OMP_WAIT_POLICY=PASSIVE`` (``lorastar/__init__.py``). A step is hundreds of
short parallel regions; with PASSIVE each one wakes its workers through the kernel. Measured on the
2-core CPU (SmolLM2 fp32, 2 threads, offline): 128-token prefill 140 -> 90 ms and 16 requests
233 -> 344 tok/s; ``benchmarks/bench_serve.py`` (vLLM's client, 16 concurrent): 331 -> 412 tok/s,
TTFT p50 177 -> 110 ms. The price, with another process busy on one of the cores: 193 -> 130 tok/s
(10000 spins: 85; PASSIVE keeps 193). So only these commands, which own their machine, spin, and
an explicit ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` in the environment wins.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

SERVER_COMMANDS = ("serve", "engine")
SERVER_SPIN_COUNT = "3000"


def openmp_env(argv: Sequence[str], user_env: Mapping[str, str]) -> dict[str, str]:
    """Environment to add for the command ``argv`` (without the program name): a brief OpenMP spin
    for the server commands unless the user set the OpenMP wait themselves (``user_env``)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in SERVER_COMMANDS or user_env:
        return {}
    return {"GOMP_SPINCOUNT": SERVER_SPIN_COUNT}


def main() -> None:
    from lorastar import _USER_OPENMP_ENV

    if "torch" not in sys.modules:  # libgomp reads it once, when torch loads it
        os.environ.update(openmp_env(sys.argv[1:], _USER_OPENMP_ENV))
    from lorastar.plugin.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
