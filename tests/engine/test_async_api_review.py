"""The async API contract (``AsyncLLM``, ``AsyncCoreClient``) against vLLM's ``AsyncLLM``: a
``shutdown`` that races a request still being added ends that request's stream (its output or a
clear ``EngineDeadError``), never leaves it hanging or surfaces a transport error."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from lorastar import AsyncLLM, SamplingParams
from lorastar.config import EngineConfig
from lorastar.engine.core_client import AsyncCoreClient
from lorastar.errors import EngineDeadError


async def test_shutdown_while_a_grammar_compiles_drains_or_ends_the_stream(
    tiny_model_dir: Any, hold: Any
) -> None:
    """A request whose add is in flight (its grammar compiling) when ``shutdown`` starts is
    in-flight: it runs within the drain; with no drain left it fails with ``EngineDeadError``.
    It used to land in the engine after the loop had stopped: its stream hung for good and the
    request held its blocks."""
    engine = AsyncLLM(model=tiny_model_dir("llama-gqa"), num_kv_blocks=64)
    sp = SamplingParams(max_tokens=4, guided_json={"type": "string"})

    async def collect() -> list[Any]:
        return [o async for o in engine.generate([5, 6, 7], sp)]

    # Drained: the add lands while shutdown waits, and the request runs to its end.
    entered, gate = hold(engine.engine, "compile_grammar")
    task = asyncio.create_task(collect())
    assert await asyncio.to_thread(entered.wait, 30)
    stopping = asyncio.create_task(engine.shutdown(drain_timeout=30))
    await asyncio.sleep(0.05)
    gate.set()
    await asyncio.wait_for(stopping, 60)
    outs = await asyncio.wait_for(task, 10)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason != "abort"
    # No drain: the add is refused once shutdown ran (generate restarts the loop, as start() does).
    entered, gate = hold(engine.engine, "compile_grammar")
    task = asyncio.create_task(collect())
    assert await asyncio.to_thread(entered.wait, 30)
    await engine.shutdown(drain_timeout=0)
    gate.set()
    with pytest.raises(EngineDeadError, match="shut down"):
        await asyncio.wait_for(task, 10)
    assert not engine.engine.requests and not engine._streams and not engine._adding
    assert engine.kv_cache_usage()["num_used_blocks"] == 0


async def test_generate_racing_a_client_shutdown_raises_engine_dead(
    tiny_model_dir: Any, tmp_path: Path, hold: Any, core_in_thread: Any
) -> None:
    """``AsyncCoreClient.generate`` tokenizing its prompt (off the event loop) while ``shutdown``
    closes the sockets: ``EngineDeadError``, not zmq's 'Socket operation on non-socket'."""
    address = f"ipc://{tmp_path}/core"
    config = EngineConfig(model=tiny_model_dir("llama-gqa"), device="cpu", dtype="float32",
                          max_model_len=128, num_kv_blocks=32, seed=0)  # fmt: skip
    with core_in_thread(config, address):
        client = await asyncio.to_thread(AsyncCoreClient, address=address, start_timeout=60)
        entered, gate = hold(client.inputs, "validate_prompt")

        async def collect() -> list[Any]:
            return [o async for o in client.generate("hello there", SamplingParams(max_tokens=2))]

        task = asyncio.create_task(collect())
        assert await asyncio.to_thread(entered.wait, 30)
        await client.shutdown(drain_timeout=0)
        gate.set()
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(task, 10)
        assert not client._streams
