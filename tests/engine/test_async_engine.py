"""AsyncLLM: streaming, early close = abort (blocks freed), concurrent requests, shutdown."""

from __future__ import annotations

import asyncio

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
