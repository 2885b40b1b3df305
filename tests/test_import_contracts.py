"""The package layering is enforced by import-linter (contracts in pyproject.toml), so a new
upward import or cycle fails CI, typing-only imports included."""

from __future__ import annotations

from pathlib import Path

import grimp
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold() -> None:
    code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    assert code == 0, "import-linter contracts broken: run `lint-imports` for the offending imports"


def test_no_two_modules_import_each_other() -> None:
    """Module-level mutual imports anywhere in lorastar (the acyclic-siblings contract sees packages)."""
    graph = grimp.build_graph("lorastar", cache_dir=None)
    pairs = {
        frozenset({a, b})
        for a in graph.modules
        for b in graph.find_modules_directly_imported_by(a)
        if a != b and graph.direct_import_exists(importer=b, imported=a)
    }
    assert not pairs, sorted(sorted(p) for p in pairs)
