"""A request id reused right after its request ended (review): as in vLLM, the id is free again
once the stream is closed or the request finished; an abort still on its way for the old request
neither refuses the new one ("already in use") nor ends it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from lorastar import AsyncLLM, SamplingParams
from lorastar.config import EngineConfig
from lorastar.engine.core_client import AsyncCoreClient

PROMPT = [5, 9, 12, 7, 3, 8]
LONG = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0)
SHORT = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)


async def _final(stream: AsyncIterator[Any]) -> Any:
    last = None
    async for out in stream:
        last = out
    return last


def _after(obj: Any, name: str) -> threading.Event:
    """An event set once ``obj.name`` has returned (or raised)."""
    done, real = threading.Event(), getattr(obj, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return real(*args, **kwargs)
        finally:
            done.set()

    setattr(obj, name, wrapped)
    return done


async def _reuse_while_the_loop_is_held(
    engine: AsyncLLM, hold: Any, before: Callable[[], Awaitable[None]], params: SamplingParams
) -> Any:
    """With the step loop held before its next step: ``before()`` (which queues an abort of "r"),
    then a request under "r" again; the loop goes on once that add is in. Its final output."""
    entered, gate = hold(engine.engine, "step")
    assert await asyncio.to_thread(entered.wait, 30)
    await before()
    added = _after(engine.engine, "add_request")
    task = asyncio.create_task(_final(engine.generate(PROMPT, params, request_id="r")))
    assert await asyncio.to_thread(added.wait, 30)
    gate.set()
    return await asyncio.wait_for(task, 60)


async def test_asyncllm_an_abandoned_id_is_reused_while_its_abort_is_queued(
    tiny_model_dir: Any, hold: Any
) -> None:
    """The abort of a closed stream is applied by the step loop; an add of the same id before
    that was refused with "request_id 'r' is already in use"."""
    engine = AsyncLLM(model=tiny_model_dir("llama-gqa"), num_kv_blocks=64, seed=0)
    try:
        want = await _final(engine.generate(PROMPT, LONG, request_id="fresh"))
        stream = engine.generate(PROMPT, LONG, request_id="r")
        await stream.__anext__()
        out = await _reuse_while_the_loop_is_held(engine, hold, stream.aclose, LONG)  # abandoned
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert not engine.engine.requests and engine.kv_cache_usage()["num_used_blocks"] == 0
    finally:
        await engine.shutdown()


async def test_asyncllm_a_late_abort_of_a_finished_id_does_not_end_its_next_request(
    tiny_model_dir: Any, hold: Any
) -> None:
    """``abort(id)`` after the request finished (a client timing out as the answer arrives) was
    applied by the step loop to whatever next held the id: the new request ended "abort"."""
    engine = AsyncLLM(model=tiny_model_dir("llama-gqa"), num_kv_blocks=64, seed=0)
    try:
        first = await _final(engine.generate(PROMPT, SHORT, request_id="r"))
        busy = engine.generate(PROMPT, LONG, request_id="busy")
        await busy.__anext__()  # the loop has work: it is held inside a step, not idle

        async def late_abort() -> None:
            await engine.abort("r")  # too late: "r" finished; queued all the same

        out = await _reuse_while_the_loop_is_held(engine, hold, late_abort, SHORT)
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == first.outputs[0].token_ids
        await busy.aclose()
    finally:
        await engine.shutdown()


@pytest.fixture
def core_address(tiny_model_dir: Any, tmp_path: Path, core_in_thread: Any) -> Any:
    address = f"ipc://{tmp_path}/core"
    config = EngineConfig(model=tiny_model_dir("llama-gqa"), device="cpu", dtype="float32",
                          max_model_len=128, num_kv_blocks=64, seed=0)  # fmt: skip
    with core_in_thread(config, address):
        yield address


async def test_core_client_an_abandoned_id_reused_at_once_runs_to_its_end(core_address: str) -> None:
    """The core answers the old request's abort with its final ("abort") output; it reached the
    frontend after the new request with the same id had registered, and ended that one."""
    client = await asyncio.to_thread(AsyncCoreClient, address=core_address, start_timeout=60)
    try:
        want = await _final(client.generate(PROMPT, LONG, request_id="fresh"))
        for _ in range(3):
            stream = client.generate(PROMPT, LONG, request_id="r")
            await stream.__anext__()
            await stream.aclose()
            out = await asyncio.wait_for(_final(client.generate(PROMPT, LONG, request_id="r")), 60)
            assert out.request_id == "r"
            assert out.outputs[0].finish_reason == "length"
            assert out.outputs[0].token_ids == want.outputs[0].token_ids
        first = await _final(client.generate(PROMPT, SHORT, request_id="s"))
        await client.abort("s")  # after it finished: must not touch the next "s"
        out = await asyncio.wait_for(_final(client.generate(PROMPT, SHORT, request_id="s")), 60)
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == first.outputs[0].token_ids
        assert not client._streams
    finally:
        await client.shutdown(drain_timeout=0)
