"""Review of the adapter listing across the core boundary (``State.adapters`` sent only when stale).

A spawned core that dies is replaced and the adapters it held are loaded again: which ones must
not depend on the listing the client last saw, which is empty while the core's engine rebuilds
after a failed step and partial while a new core is still being given them back. A load answered
after such a rebuild must be in the rebuilt engine, not only in the one it replaced.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from lorastar.adapters.info import AdapterInfo
from lorastar.config import EngineConfig
from lorastar.engine.core_client import AsyncCoreClient
from lorastar.engine.messages import Call, Ready, Reply, State
from lorastar.engine.sampling import SamplingParams
from lorastar.errors import RequestFailedError
from tests.conftest import make_peft_adapter
from tests.engine.test_core_process import _wait


def _row(name: str) -> AdapterInfo:
    return AdapterInfo(name=name, path=f"/adapters/{name}", rank=8, content_hash=name, target_modules=("q_proj",),
                       tier="cpu", slot=None, in_flight=0)  # fmt: skip


def _ready(core_id: str, tokenizer_dir: str, rows: list[AdapterInfo]) -> Ready:
    return Ready(core_id, "m", tokenizer_dir, tokenizer_dir, None, 256, 1 << 20, 256, [],
                 State(core_id, None, rows))  # fmt: skip


class _Spawner:
    """An ``AsyncCoreClient`` that owns its core, with the process stubbed: each (re)spawned core
    answers ``Ready`` with an empty listing; the calls the client sends are recorded."""

    def __init__(self, tokenizer_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dir, self.cores, self.calls = tokenizer_dir, 0, []
        monkeypatch.setattr(AsyncCoreClient, "_spawn", lambda c: None)
        monkeypatch.setattr(AsyncCoreClient, "_hello_and_wait", lambda c: self._answer(c))
        monkeypatch.setattr(AsyncCoreClient, "_reconnect_input", lambda c: None)
        self.client = AsyncCoreClient(EngineConfig(model=tokenizer_dir, device="cpu"))
        self.client._send = self._record  # type: ignore[method-assign]

    def _answer(self, c: AsyncCoreClient) -> Ready:
        self.cores += 1
        ready = _ready(f"core-{self.cores}", self.dir, [])
        c._on_ready(ready)
        return ready

    def _record(self, msg: Any) -> bool:
        if isinstance(msg, Call):
            self.calls.append(msg)
        return True

    @property
    def core_id(self) -> str:
        return f"core-{self.cores}"

    def loads(self) -> list[tuple[str, str]]:
        return sorted((m.args[0], m.args[1]) for m in self.calls if m.method == "load_adapter")


@pytest.fixture
def spawner(tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Spawner]:
    s = _Spawner(tiny_model_dir("llama-gqa"), monkeypatch)
    yield s
    asyncio.run(s.client.shutdown(drain_timeout=0))


def test_a_spawned_core_killed_while_its_engine_rebuilds_gets_its_adapters_back(spawner: _Spawner) -> None:
    """A failed step makes the core rebuild its engine: its States list no adapter meanwhile. The
    process dying then (a rebuild that runs out of memory) must not lose the adapters it held."""
    c, rows = spawner.client, [_row("a"), _row("b")]
    c._handle(State(spawner.core_id, None, rows))
    assert [a.name for a in c.list_adapters()] == ["a", "b"]
    c._handle(State(spawner.core_id, None, [], restarting=True))  # rebuilding its engine
    c._core_died(-9)
    assert spawner.loads() == [("a", "/adapters/a"), ("b", "/adapters/b")]


def test_a_spawned_core_killed_while_it_is_given_its_adapters_back_loses_none(spawner: _Spawner) -> None:
    """The new core died before every adapter was loaded into it again: the next one gets them all."""
    c, rows = spawner.client, [_row("a"), _row("b")]
    c._handle(State(spawner.core_id, None, rows))
    c._core_died(-9)
    first = {m.args[0]: m for m in spawner.calls}
    assert sorted(first) == ["a", "b"] and c.restarting  # reloading
    c._handle(State(spawner.core_id, None, rows[:1]))  # "a" is back; "b" is still being read
    c._handle(Reply(first["a"].call_id, {"name": "a", "path": "/adapters/a"}))
    spawner.calls.clear()
    c._core_died(-9)
    assert spawner.loads() == [("a", "/adapters/a"), ("b", "/adapters/b")]
    for m in spawner.calls:  # the third core loads both
        c._handle(Reply(m.call_id, {"name": m.args[0], "path": m.args[1]}))
    c._handle(State(spawner.core_id, None, rows))
    assert not c.restarting and [a.name for a in c.list_adapters()] == ["a", "b"]
    assert c._adapters == {"a": "/adapters/a", "b": "/adapters/b"}


async def test_a_load_under_way_while_the_core_rebuilds_its_engine_is_in_the_rebuilt_one(
    tiny_model_dir: Any, tmp_path: Any, core_in_thread: Any, hold: Any
) -> None:
    """The load read its files while a step failed: the rebuild took the adapters the old engine
    held before this one registered there. Its success must mean the core serves it."""
    model = tiny_model_dir("llama-gqa")
    adapter = make_peft_adapter(model, tmp_path / "ad", seed=1, r=4)
    config = EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=64, max_loras=2)
    with core_in_thread(config, f"ipc://{tmp_path}/core") as core:

        def boom(*_: Any, **__: Any) -> Any:
            raise RuntimeError("injected forward failure")

        core.engine.runner.execute = boom  # the rebuilt engine runs normally
        entered, gate = hold(core.engine, "_read_adapter")
        c = await asyncio.to_thread(AsyncCoreClient, address=f"ipc://{tmp_path}/core", start_timeout=60)
        try:
            load = asyncio.ensure_future(c.load_adapter("ad", adapter))
            assert await asyncio.to_thread(entered.wait, 30)
            with pytest.raises(RequestFailedError):
                _ = [o async for o in c.generate("hello", SamplingParams(max_tokens=2))]
            assert await asyncio.to_thread(_wait, lambda: c.num_restarts == 1 and not c.restarting, 60)
            gate.set()
            info = await asyncio.wait_for(load, 30)
            assert info.name == "ad" and c.has_adapter("ad") and "ad" in core.engine.registry
            outs = [o async for o in c.generate("hello", SamplingParams(max_tokens=2), adapter="ad")]
            assert outs[-1].finished
        finally:
            gate.set()
            await c.shutdown(drain_timeout=0)


async def test_a_load_answered_after_another_worker_unloaded_the_name_is_not_reloaded_later(
    tiny_model_dir: Any, tmp_path: Any, core_in_thread: Any
) -> None:
    """Worker a loads ``x``; worker b unloads it just after, before a's caller resumes. a's map of
    what to load into a restarted core must follow the listing (without ``x``), not the reply."""
    model = tiny_model_dir("llama-gqa")
    adapter = make_peft_adapter(model, tmp_path / "x", seed=1, r=4)
    config = EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=64, max_loras=2)
    address = f"ipc://{tmp_path}/core"
    with core_in_thread(config, address):
        a, b = await asyncio.gather(
            *(asyncio.to_thread(AsyncCoreClient, address=address, start_timeout=60) for _ in range(2))
        )
        try:
            load = asyncio.ensure_future(a.load_adapter("x", adapter))
            await asyncio.sleep(0)  # the call is sent
            # This loop does not run until b's unload is through: a's caller resumes only then.
            assert _wait(lambda: a.has_adapter("x"), 30)
            unload = b._start_call("unload_adapter", ["x"])
            assert _wait(lambda: unload.done() and not a.has_adapter("x"), 30)
            assert (await load).name == "x"
            assert a._adapters == {} and b._adapters == {}
        finally:
            await asyncio.gather(a.shutdown(drain_timeout=0), b.shutdown(drain_timeout=0))


async def test_an_in_process_load_under_way_while_the_engine_rebuilds_is_in_the_rebuilt_one(
    tiny_model_dir: Any, tmp_path: Any, hold: Any
) -> None:
    """The in-process ``AsyncLLM`` had the same race as the core: the load registered into the engine
    a failed step replaced, after the rebuild took its adapters, and still answered success."""
    from lorastar.engine.async_engine import AsyncLLM

    model = tiny_model_dir("llama-gqa")
    adapter = make_peft_adapter(model, tmp_path / "ad", seed=1, r=4)
    llm = AsyncLLM(EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=64, max_loras=2))
    llm.restart_backoff = (0.05, 0.1)
    await llm.start()
    try:

        def boom(*_: Any, **__: Any) -> Any:
            raise RuntimeError("injected forward failure")

        llm.engine.runner.execute = boom  # the rebuilt engine runs normally
        entered, gate = hold(llm.engine, "_read_adapter")
        load = asyncio.ensure_future(llm.load_adapter("ad", adapter))
        assert await asyncio.to_thread(entered.wait, 30)
        with pytest.raises(RequestFailedError):
            _ = [o async for o in llm.generate("hello", SamplingParams(max_tokens=2))]
        assert await asyncio.to_thread(_wait, lambda: llm.num_restarts == 1 and not llm.restarting, 60)
        gate.set()
        info = await asyncio.wait_for(load, 30)
        assert info.name == "ad" and llm.has_adapter("ad")
        outs = [o async for o in llm.generate("hello", SamplingParams(max_tokens=2), adapter="ad")]
        assert outs[-1].finished
    finally:
        gate.set()
        await llm.shutdown(drain_timeout=0)
