"""Several app workers (``AsyncCoreClient``s) sharing one engine core (``lorastar engine``).

The core runs on a thread of this process (``EngineCoreProc.run``, as ``lorastar engine`` runs it);
two clients stand for two workers. At most two core starts: the module's core, and the one that
replaces it in the last test.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lorastar.config import EngineConfig
from lorastar.engine.core_client import AsyncCoreClient
from lorastar.engine.core_proc import EngineCoreProc
from lorastar.engine.sampling import SamplingParams
from lorastar.errors import AdapterExistsError, AdapterNotFoundError
from tests.conftest import make_peft_adapter


def _config(model: str) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=256,
                        max_num_seqs=16, max_loras=2, max_cpu_loras=4, seed=0)  # fmt: skip


class _Core:
    """An ``EngineCoreProc`` stepping on a thread of its own."""

    def __init__(self, config: EngineConfig, address: str) -> None:
        self.proc = EngineCoreProc(config, address)
        self.thread = threading.Thread(target=self.proc.run, name="test-core", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.proc.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


class _Shared:
    def __init__(self, model: str, address: str, adapters: Path) -> None:
        self.model, self.address, self.adapters = model, address, adapters
        self.core = _Core(_config(model), address)


@pytest.fixture(scope="module")
def shared(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Shared]:
    model = tiny_model_dir("llama-gqa")
    tmp = tmp_path_factory.mktemp("shared")
    for i, name in enumerate(("one", "two")):
        make_peft_adapter(model, tmp / name, seed=10 + i, r=8)
    s = _Shared(model, f"ipc://{tmp}/core", tmp)
    yield s
    if s.core.thread.is_alive():
        s.core.stop()


async def _client(address: str) -> AsyncCoreClient:
    return await asyncio.to_thread(AsyncCoreClient, address=address, start_timeout=60)


async def _collect(c: AsyncCoreClient, prompt: Any, sp: SamplingParams, **kw: Any) -> list[Any]:
    return [o async for o in c.generate(prompt, sp, **kw)]


def _wait(predicate: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


async def test_workers_choosing_the_same_request_id_each_get_their_own_request(shared: _Shared) -> None:
    """Two workers choosing the same request id (the Python API takes one; vLLM keeps its internal
    ids unique): each gets its own request under that id, and one's abort never ends the other's.
    (The core refused the second as "already in use", and an abort ended whichever held the id.)"""
    a, b = await _client(shared.address), await _client(shared.address)
    proc = shared.core.proc
    try:
        long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        ga = a.generate("hello", long, request_id="r1")
        assert not (await ga.__anext__()).finished
        rb = await _collect(b, "hello", GREEDY, request_id="r1")
        assert rb[-1].request_id == "r1" and rb[-1].finished
        assert rb[-1].outputs[0].finish_reason == "length" and len(rb[-1].outputs[0].token_ids) == 4
        await b.abort("r1")  # b's is over: a's is not b's to abort
        gb = b.generate("hi", long, request_id="r1")
        assert not (await gb.__anext__()).finished  # (the core has read b's abort before this)
        await b.abort("r1")  # b's own open one
        last_b = [o async for o in gb][-1]
        assert last_b.request_id == "r1" and last_b.outputs[0].finish_reason == "abort"
        last_a = [o async for o in ga][-1]
        assert last_a.request_id == "r1" and last_a.outputs[0].finish_reason == "length"
        assert len(last_a.outputs[0].token_ids) == 100
        assert await asyncio.to_thread(_wait, lambda: not (proc.owner or proc.alias or proc.client_rid), 5)
    finally:
        await a.shutdown(drain_timeout=0)
        await b.shutdown(drain_timeout=0)


async def test_an_adapter_loaded_through_one_worker_serves_another(shared: _Shared) -> None:
    """Loaded through a, an adapter is listed by b (its /v1/models) and serves b's requests; unloaded
    through a while b streams on it, b's request ends normally and b's next one is a 404."""
    a, b = await _client(shared.address), await _client(shared.address)
    try:
        await a.load_adapter("one", str(shared.adapters / "one"))
        names = lambda: [x.name for x in b.list_adapters()]  # noqa: E731
        assert await asyncio.to_thread(_wait, lambda: "one" in names(), 5)  # b's /v1/models
        gb = b.generate("hi", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), adapter="one")
        assert not (await gb.__anext__()).finished
        await a.unload_adapter("one")
        last = [o async for o in gb][-1]
        assert last.outputs[0].finish_reason == "length" and len(last.outputs[0].token_ids) == 30
        assert await asyncio.to_thread(_wait, lambda: "one" not in names(), 5)
        with pytest.raises(AdapterNotFoundError, match="one"):
            await _collect(b, "hi", GREEDY, adapter="one")
    finally:
        await a.shutdown(drain_timeout=0)
        await b.shutdown(drain_timeout=0)


async def test_a_new_name_loaded_through_two_workers_at_once_is_loaded_once(shared: _Shared) -> None:
    """Each worker's route checks "already loaded" under its own lock, so two workers loading one new
    name with different weights both answered 200 and the last silently won; the core checks a
    ``new`` load under the lock that registers it: exactly one wins, the other is refused."""
    a, b = await _client(shared.address), await _client(shared.address)
    try:
        got = await asyncio.gather(
            a.load_adapter("race", str(shared.adapters / "one"), new=True),
            b.load_adapter("race", str(shared.adapters / "two"), new=True),
            return_exceptions=True,
        )
        refused = [g for g in got if isinstance(g, BaseException)]
        assert len(refused) == 1 and isinstance(refused[0], AdapterExistsError), got
        assert "race" in str(refused[0]) and "already been loaded" in str(refused[0])
        # a replacing load (vLLM's load_inplace) still rebinds the name
        await b.load_adapter("race", str(shared.adapters / "two"))
        await a.unload_adapter("race")
    finally:
        await a.shutdown(drain_timeout=0)
        await b.shutdown(drain_timeout=0)


async def test_a_call_the_core_cannot_read_is_answered_not_left_waiting(shared: _Shared) -> None:
    """A worker of another lorastar version may send a call the core cannot decode (here a bool where
    it reads strings): the core dropped it and the caller waited forever; it now gets an error."""
    a = await _client(shared.address)
    try:
        fut = a._start_call("load_adapter", ["x", str(shared.adapters / "one"), True])  # type: ignore[list-item]
        with pytest.raises(RuntimeError, match="could not read this message"):
            await asyncio.wait_for(asyncio.wrap_future(fut), 30)
        assert "x" not in [x.name for x in a.list_adapters()]
        assert len(await _collect(a, "hi", GREEDY)) >= 1  # the core serves on
    finally:
        await a.shutdown(drain_timeout=0)


async def test_a_restarted_core_serves_every_adapter_it_held(shared: _Shared) -> None:
    """The core restarted: what it held is loaded again by the workers that remain, also what a
    worker that has since exited loaded; what one worker unloaded stays unloaded."""
    a, b = await _client(shared.address), await _client(shared.address)
    b.dead_timeout = 2.0
    try:
        await b.load_adapter("two", str(shared.adapters / "two"))  # unloaded through a below
        await a.load_adapter("one", str(shared.adapters / "one"))  # a exits below
        await a.unload_adapter("two")
        await a.shutdown(drain_timeout=0)
        assert await asyncio.to_thread(_wait, lambda: [x.name for x in b.list_adapters()] == ["one"], 5)
        shared.core.stop()
        shared.core = await asyncio.to_thread(_Core, _config(shared.model), shared.address)
        new = shared.core.proc
        assert await asyncio.to_thread(_wait, lambda: b._core_id == new.core_id and not b.restarting, 30)
        assert [x.name for x in new.engine.list_adapters()] == ["one"]
        outs = await _collect(b, "hi", GREEDY, adapter="one")
        assert outs[-1].finished
    finally:
        await a.shutdown(drain_timeout=0)
        await b.shutdown(drain_timeout=0)
