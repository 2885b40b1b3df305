"""A request for an adapter on the disk tier (more adapters than ``max_cpu_loras``) reads it from
disk before the engine's lock is taken: the step loop, and every running request with it, goes on
while the file is read and hashed. Before, ``AdapterRegistry.acquire`` read it under the engine's
lock and every stream stalled for the read (vLLM's worker stalls the same way; LoRAX prefetches).

The tests hold the read open with an event (no timing): the step loop must make progress while
the read is blocked, in-process and through the core process."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from lorastar import LLM, SamplingParams
from lorastar.adapters.registry import AdapterRegistry
from tests.conftest import make_peft_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [4, 5, 6, 7]
KW = {"num_kv_blocks": 64, "max_model_len": 128, "max_loras": 1, "max_cpu_loras": 1, "max_lora_rank": 8}


class GatedLoader:
    """Wraps a registry's loader: a read of ``path`` waits for ``release`` (``reading`` is set
    once it has started)."""

    def __init__(self, registry: AdapterRegistry, path: str) -> None:
        self.inner, self.path = registry._loader, path
        self.reading, self.release = threading.Event(), threading.Event()
        registry._loader = self  # type: ignore[assignment]

    def __call__(self, path: str) -> Any:
        if path == self.path:
            self.reading.set()
            assert self.release.wait(30), "the test never released the read"
        return self.inner(path)


def test_a_disk_tier_read_does_not_stall_the_step_loop(tiny_model_dir, tmp_path: Path) -> None:  # noqa: ANN001
    base = tiny_model_dir("llama-gqa")
    pa = make_peft_adapter(base, tmp_path / "a", 1)
    pb = make_peft_adapter(base, tmp_path / "b", 2)
    llm = LLM(base, **KW)
    eng = llm.engine
    llm.load_adapter("a", pa)
    want_a = llm.generate(PROMPT, GREEDY, adapter="a")[0].outputs[0].token_ids
    llm.load_adapter("b", pb)
    llm.generate(PROMPT, GREEDY, adapter="b")  # b takes the one slot; max_cpu_loras=1: a goes to disk
    assert {i.name: i.tier for i in llm.list_adapters()}["a"] == "disk"
    running = eng.add_request(
        PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), adapter="b"
    )
    eng.step()
    gate = GatedLoader(eng.registry, pa)
    added: list[Any] = []
    adder = threading.Thread(target=lambda: added.append(eng.add_request(PROMPT, GREEDY, adapter="a")))
    adder.start()
    try:
        assert gate.reading.wait(10)
        # The read is blocked: steps still run, and the running request still gains tokens.
        before = running.sequences[0].num_output_tokens
        stepper = threading.Thread(target=lambda: [eng.step() for _ in range(3)])
        stepper.start()
        stepper.join(10)
        assert not stepper.is_alive(), "the step loop waited for the adapter's disk read"
        assert running.sequences[0].num_output_tokens == before + 3
        assert not added  # the request is not queued before its adapter is in host memory
    finally:
        gate.release.set()
        adder.join(10)
    assert len(added) == 1
    outs: dict[str, Any] = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out
    assert outs[added[0].request_id].outputs[0].token_ids == want_a
    eng.check_invariants()
    assert eng.kv_cache_usage().num_used_blocks == 0
    assert all(n == 0 for n in eng.registry.stats()["in_flight"].values())
    assert gate.inner is not None


def test_preload_reads_outside_the_registry_lock(tmp_path: Path) -> None:
    """The registry itself: while one adapter's weights are being read, the step loop's slot calls
    and other requests' acquires go through; the read's result is then what ``acquire`` uses (one
    read), and a name unloaded during its read is not brought back."""
    from tests.adapters.test_registry import FakeDisk

    disk = FakeDisk()
    reg = AdapterRegistry(1, 2, disk)  # type: ignore[arg-type]
    px, wx = disk.put("x")
    py, wy = disk.put("y")
    reg.register("x", px, wx)
    reg.register("y", py, wy)
    reg.register("z", *disk.put("z"))  # max_cpu_loras=2: x (the least recent) drops to disk
    assert reg.on_disk("x") and not reg.on_disk("y") and not reg.on_disk("nope")
    gate = GatedLoader(reg, px)
    done: list[bool] = []
    t = threading.Thread(target=lambda: done.append(reg.preload("x")))
    t.start()
    assert gate.reading.wait(10)
    ey = reg.acquire("y")  # would wait on the registry's lock if the read held it
    assert reg.try_reserve(ey, set()) is not None
    gate.release.set()
    t.join(10)
    assert done == [True] and not reg.on_disk("x")
    reads = len(disk.reads)
    ex = reg.acquire("x")
    assert len(disk.reads) == reads and ex.weights is wx  # acquire found it in host memory
    reg.release(ex)
    reg.release(ey)
    reg.check_invariants()
    # unloaded while being read: the read is dropped
    reg.register("w", *disk.put("w"))  # the least recent idle one drops to disk
    name = next(n for n in "xyz" if reg.on_disk(n))
    gate = GatedLoader(reg, f"/adapters/{name}")
    t = threading.Thread(target=lambda: done.append(reg.preload(name)))
    t.start()
    assert gate.reading.wait(10)
    reg.unregister(name)
    gate.release.set()
    t.join(10)
    assert done[-1] is False and name not in reg
    reg.check_invariants()


async def test_a_core_process_reads_off_its_step_loop(
    tiny_model_dir, tmp_path: Path, core_in_thread: Any
) -> None:  # noqa: ANN001
    """The core process adds requests on its step loop: a request whose adapter is on disk waits
    on the grammar thread for the read (as one with a grammar waits for its compile), and the
    other streams go on meanwhile."""
    import asyncio

    from lorastar.config import EngineConfig
    from lorastar.engine.core_client import AsyncCoreClient

    base = tiny_model_dir("llama-gqa")
    pa = make_peft_adapter(base, tmp_path / "a", 1)
    pb = make_peft_adapter(base, tmp_path / "b", 2)
    address = f"ipc://{tmp_path}/core"
    with core_in_thread(
        EngineConfig(model=base, device="cpu", dtype="float32", seed=0, **KW), address
    ) as core:
        client = await asyncio.to_thread(AsyncCoreClient, address=address, start_timeout=60)
        try:
            await client.load_adapter("a", pa)
            want_a = [o async for o in client.generate(PROMPT, GREEDY, adapter="a")][-1].outputs[0].token_ids
            await client.load_adapter("b", pb)
            [o async for o in client.generate(PROMPT, GREEDY, adapter="b")]  # a goes to disk
            assert core.engine.registry.on_disk("a")
            gate = GatedLoader(core.engine.registry, pa)
            long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
            stream = client.generate(PROMPT, long, adapter="b")
            await stream.__anext__()
            task = asyncio.ensure_future(_final(client.generate(PROMPT, GREEDY, adapter="a")))
            try:
                assert await asyncio.to_thread(gate.reading.wait, 10)
                for _ in range(3):  # b's stream goes on while a's read is blocked
                    await asyncio.wait_for(stream.__anext__(), 10)
                assert not task.done()
            finally:
                gate.release.set()
            out = await asyncio.wait_for(task, 30)
            assert out.outputs[0].token_ids == want_a
            await stream.aclose()
        finally:
            await client.shutdown(drain_timeout=0)


async def _final(gen: Any) -> Any:
    last = None
    async for out in gen:
        last = out
    return last
