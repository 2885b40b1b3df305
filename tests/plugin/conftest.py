"""Fixtures of the plugin tests: a tiny random Llama (SmolLM2's tokenizer), tiny real PEFT adapters,
and a real uvicorn server on 127.0.0.1 in a background thread."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # plugin_support, plugin_fake_engine

from plugin_support import ServerThread, engine_config, make_adapter  # noqa: E402

# ----------------------------------------------------------------------------- tiny model + adapters


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_dir: Any) -> Path:
    """The plugin tests' model as a folder: the shared factory's "llama-plugin" (tests/conftest.py), a
    2-layer random Llama (hidden 64) with SmolLM2's tokenizer and chat template."""
    return Path(tiny_model_dir("llama-plugin"))


@pytest.fixture(scope="session")
def adapter_root(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``alpha``, ``beta``, ``gamma`` under one root (the runtime-loading root of the tests)."""
    root = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate(("alpha", "beta", "gamma")):
        make_adapter(tiny_model_dir, root / name, seed=100 + i)
    return root


@pytest.fixture(scope="session")
def real_server(tiny_model_dir: Path, adapter_root: Path) -> Iterator[Any]:
    """The shared live server: a Litestar app with its own route + the plugin (real engine)."""
    from litestar import Litestar, get

    from lorastar.plugin import LoraStarConfig, LoraStarPlugin

    @get("/app-own")
    async def own() -> dict[str, str]:
        return {"mine": "yes"}

    plugin = LoraStarPlugin(
        LoraStarConfig(
            engine=engine_config(tiny_model_dir),
            served_model_name="tiny",
            adapters={"alpha": str(adapter_root / "alpha"), "beta": str(adapter_root / "beta")},
            adapter_root=adapter_root,
            admin_token="admin-secret",
        )
    )
    app = Litestar(route_handlers=[own], plugins=[plugin])
    with ServerThread(app) as srv:
        srv.plugin = plugin  # type: ignore[attr-defined]
        yield srv


@pytest.fixture(scope="session")
def offline_llm(tiny_model_dir: Path, adapter_root: Path) -> Any:
    """The offline ``LLM`` on ``real_server``'s weights with its adapter ``alpha``: what the server's
    answers must equal (read-only: tests must not load or unload adapters on it)."""
    from lorastar import LLM

    llm = LLM(config=engine_config(tiny_model_dir))
    llm.load_adapter("alpha", str(adapter_root / "alpha"))
    return llm


@pytest.fixture
def restore_lorastar_logger() -> Iterator[None]:
    """For in-process CLI runs: a command adds a stderr handler to the ``lorastar`` logger
    (CliRunner's stream, closed after) and sets its level; both are put back."""
    import logging

    log = logging.getLogger("lorastar")
    handlers, propagate, level = list(log.handlers), log.propagate, log.level
    yield
    log.handlers[:] = handlers
    log.propagate, log.level = propagate, level
