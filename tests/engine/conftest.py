"""Fixtures shared by the engine tests."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

Gate = tuple[threading.Event, threading.Event]


def _hold(obj: Any, name: str) -> Gate:
    """Hold ``obj.name`` (a method run on a worker thread) until the returned gate is set; the
    first event is set once a call has entered it."""
    entered, gate = threading.Event(), threading.Event()
    real = getattr(obj, name)

    def held(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert gate.wait(30)
        return real(*args, **kwargs)

    setattr(obj, name, held)
    return entered, gate


@contextlib.contextmanager
def _core_in_thread(config: Any, address: str) -> Iterator[Any]:
    """An ``EngineCoreProc`` serving ``address`` on a thread of this process (no spawn); stopped
    on exit."""
    from lorastar.engine.core_proc import EngineCoreProc

    core = EngineCoreProc(config, address)
    thread = threading.Thread(target=core.run, name="test-core", daemon=True)
    thread.start()
    try:
        yield core
    finally:
        core.stop.set()
        thread.join(30)


@pytest.fixture
def core_in_thread() -> Callable[[Any, str], contextlib.AbstractContextManager[Any]]:
    """``with core_in_thread(config, address): ...``: a core for clients to connect to."""
    return _core_in_thread


@pytest.fixture
def hold() -> Callable[[Any, str], Gate]:
    """``hold(obj, "method")`` -> (entered, gate): that method waits for ``gate.set()``."""
    return _hold


@pytest.fixture(scope="session")
def model_dir() -> str:
    """The embedded SmolLM2-135M-Instruct's folder (converted once into the cache)."""
    from lorastar.models.default import default_model_dir

    return str(default_model_dir(progress=False))
