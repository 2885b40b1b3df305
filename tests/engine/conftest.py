"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_dir() -> str:
    """The embedded SmolLM2-135M-Instruct's folder (converted once into the cache)."""
    from lorastar.models.default import default_model_dir

    return str(default_model_dir(progress=False))
