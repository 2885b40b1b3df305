"""AsyncLLM: streaming, early close = abort (blocks freed), concurrent requests, shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest

from lorastar import LLM, AsyncLLM, SamplingParams
from lorastar.errors import AdapterNotFoundError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


async def _collect(engine: AsyncLLM, prompt: list[int], params: SamplingParams = GREEDY) -> list:  # noqa: ANN401
    return [o async for o in engine.generate(prompt, params)]


async def test_streams_match_offline_and_abort_frees(tiny_model_dir) -> None:  # noqa: ANN001
    path = tiny_model_dir("llama-gqa")
    prompts = [[5 + i] * (3 + 4 * i) for i in range(6)]
    want = [o.outputs[0].token_ids for o in LLM(path, num_kv_blocks=128).generate(prompts, GREEDY)]
    engine = AsyncLLM(model=path, num_kv_blocks=128)
    await engine.start()
    streams = await asyncio.gather(*[_collect(engine, p) for p in prompts])
    for s, w in zip(streams, want):
        assert s[-1].finished and s[-1].outputs[0].token_ids == w
        lens = [len(o.outputs[0].token_ids) for o in s]
        assert lens == sorted(lens)  # cumulative outputs
    # Leave a stream after its first output: the request is aborted and its blocks freed.
    gen = engine.generate([3] * 50, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    async for _ in gen:
        break
    await gen.aclose()
    for _ in range(100):
        await asyncio.sleep(0.02)
        if engine.kv_cache_usage()["num_used_blocks"] == 0 and not engine.engine.requests:
            break
    assert engine.kv_cache_usage()["num_used_blocks"] == 0
    with pytest.raises(ValueError, match="prompt"):
        await _collect(engine, [])
    with pytest.raises(AdapterNotFoundError):
        async for _ in engine.generate([1, 2], GREEDY, adapter="missing"):
            pass
    # Cancelled while the request is being added: it is added, then aborted (nothing runs on).
    for _ in range(5):
        task = asyncio.create_task(
            _collect(engine, [4] * 30, SamplingParams(max_tokens=400, ignore_eos=True))
        )
        await asyncio.sleep(0)  # let it reach the add
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    for _ in range(200):
        await asyncio.sleep(0.02)
        if not engine.engine.requests:
            break
    assert not engine.engine.requests and engine.kv_cache_usage()["num_used_blocks"] == 0
    # Shutdown lets an in-flight request finish.
    task = asyncio.create_task(_collect(engine, [9, 9, 9]))
    await asyncio.sleep(0.05)
    await engine.shutdown(drain_timeout=10.0)
    out = await task
    assert out[-1].finished and out[-1].outputs[0].finish_reason == "length"
    engine.engine.check_invariants()


async def test_failed_step_fails_its_request_and_moves_queued_ones(tiny_model_dir) -> None:  # noqa: ANN001
    """The request in the failing step gets RequestFailedError; a request still queued runs on the
    rebuilt engine to the same greedy output as a clean run; nothing is held afterwards."""
    from lorastar.errors import RequestFailedError

    path = tiny_model_dir("llama-gqa")
    queued_prompt = [7] * 9
    want = LLM(path, num_kv_blocks=64).generate([queued_prompt], GREEDY)[0].outputs[0].token_ids
    engine = AsyncLLM(model=path, num_kv_blocks=64, max_num_seqs=1)  # the second request must wait
    engine.restart_backoff = (0.05, 0.1)
    await engine.start()
    inner = engine.engine
    real_step, failed = inner.step, []

    def failing_step() -> list:  # noqa: ANN401
        time.sleep(0.002)  # a model slower than this tiny one: lets the other thread take the lock
        if len(inner.requests) == 2 and not failed:  # once the second request is queued
            failed.append(True)
            raise RuntimeError("simulated kernel failure")
        return real_step()

    inner.step = failing_step
    first = engine.generate([5] * 20, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    await first.__anext__()  # running (and holding the only seat) before the second arrives
    second = asyncio.ensure_future(_collect(engine, queued_prompt))
    with pytest.raises(RequestFailedError):
        async for _ in first:
            pass
    outs = await second
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == want
    assert engine.num_restarts == 1 and engine.engine is not inner and not engine.restarting
    engine.engine.check_invariants()
    assert engine.kv_cache_usage()["num_used_blocks"] == 0
    await engine.shutdown(drain_timeout=0)


async def test_a_slow_grammar_holds_back_only_its_own_request(tiny_model_dir) -> None:  # noqa: ANN001
    """Compiling a grammar can take seconds (a string maxLength of a million: 1.4 s on the dev VM):
    it runs before the add takes its lock, so a request sent after it is added, runs and ends first,
    and the step loop serves running requests meanwhile."""
    engine = AsyncLLM(model=tiny_model_dir("llama-gqa"), num_kv_blocks=128)
    await engine.start()
    order: list[str] = []

    async def run(tag: str, sp: SamplingParams) -> None:
        await _collect(engine, [5, 6, 7], sp)
        order.append(tag)

    slow = SamplingParams(max_tokens=4, guided_json={"type": "string", "maxLength": 10**6 + 3})
    await asyncio.gather(run("slow", slow), run("plain", SamplingParams(max_tokens=4, ignore_eos=True)))
    assert order == ["plain", "slow"]
    assert not engine.engine.requests and engine.kv_cache_usage()["num_used_blocks"] == 0
    await engine.shutdown()


async def test_abort_while_the_request_is_being_added_ends_it(tiny_model_dir) -> None:  # noqa: ANN001
    """``abort(rid)`` while rid's add is still on its worker thread (a grammar compiling, say): the
    loop applies it before the request exists, so it is applied again once the add lands. The
    stream ends with finish_reason 'abort' instead of running to max_tokens."""
    import threading

    engine = AsyncLLM(model=tiny_model_dir("llama-gqa"), num_kv_blocks=64)
    await engine.start()
    entered, gate = threading.Event(), threading.Event()
    add = engine.engine.add_request

    def held_add(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        entered.set()
        assert gate.wait(30)
        return add(*args, **kwargs)

    engine.engine.add_request = held_add  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    task = asyncio.create_task(_collect_id(engine, [4] * 8, params, "held"))
    assert await asyncio.to_thread(entered.wait, 30)
    await engine.abort("held")
    for _ in range(50):  # the loop takes the abort (finding nothing) before the add lands
        await asyncio.sleep(0.01)
        if not engine._aborts:
            break
    assert not engine._aborts
    gate.set()
    outs = await asyncio.wait_for(task, 60)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 200
    assert not engine.engine.requests and not engine._adding and not engine._aborted_adding
    await engine.shutdown(drain_timeout=0)


async def _collect_id(engine: AsyncLLM, prompt: list[int], params: SamplingParams, rid: str) -> list:  # noqa: ANN401
    return [o async for o in engine.generate(prompt, params, request_id=rid)]
