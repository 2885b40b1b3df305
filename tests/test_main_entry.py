"""The ``lorastar`` command's OpenMP setting (lorastar/__main__.py): server commands spin briefly,
everything else and any user choice is left alone, and it is set before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lorastar.__main__ import SERVER_SPIN_COUNT, openmp_env


@pytest.mark.parametrize(
    ("argv", "user", "want"),
    [
        (["serve"], {}, {"GOMP_SPINCOUNT": SERVER_SPIN_COUNT}),
        (["engine", "--address", "ipc:///tmp/x"], {}, {"GOMP_SPINCOUNT": SERVER_SPIN_COUNT}),
        (["--help"], {}, {}),
        (["lora", "load", "a", "/p"], {}, {}),  # a client command: no model here
        (["serve"], {"OMP_WAIT_POLICY": "PASSIVE"}, {}),  # the user's choice wins
        (["serve"], {"GOMP_SPINCOUNT": "0"}, {}),
    ],
)
def test_openmp_env(argv: list[str], user: dict[str, str], want: dict[str, str]) -> None:
    assert openmp_env(argv, user) == want


def _run(code: str, env: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_the_entry_sets_the_spin_before_torch_loads() -> None:
    code = (
        "import sys, os; sys.argv = ['lorastar', 'serve', '--help']\n"
        "import lorastar.__main__ as m\n"
        "assert 'torch' not in sys.modules\n"
        "try:\n    m.main()\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules  # serve's model load imports it: after the setting\n"
        "import torch\n"
        "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"
    )
    assert _run(code, {}).splitlines()[-1] == f"{SERVER_SPIN_COUNT} PASSIVE True"
    assert _run(code, {"OMP_WAIT_POLICY": "ACTIVE"}).splitlines()[-1] == "None ACTIVE True"


def test_client_commands_do_not_import_torch() -> None:
    """``lorastar lora ...`` and ``--help`` are HTTP clients and help text: without torch (and the
    plugin's engine side) a command took 0.2 s instead of 2.4 here (``lorastar.plugin`` is lazy)."""
    code = (
        "import sys; sys.argv = ['lorastar', 'lora', 'list', '--url', 'http://127.0.0.1:9']\n"
        "import lorastar.__main__ as m\n"
        "try:\n    m.main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(k for k in ('torch', 'transformers', 'lorastar.plugin.plugin') if k in sys.modules))"
    )
    assert _run(code, {}).splitlines()[-1] == "[]"


def test_the_plugin_and_the_core_client_import_without_torch() -> None:
    """A server whose core runs in its own process imports torch only through transformers'
    tokenizer, on the thread that warms it while the core starts (``core_client.py``): importing
    the plugin and the client first took ~1 s before the core was even spawned."""
    code = (
        "import sys\n"
        "import lorastar.plugin.plugin, lorastar.engine.core_client, lorastar.plugin.routes.admin\n"
        "print('torch' in sys.modules)"
    )
    assert _run(code, {}).splitlines()[-1] == "False"
