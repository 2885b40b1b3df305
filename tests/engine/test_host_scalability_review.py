"""Host-side scalability: per-request and per-step work that must not grow with the queue, the
output so far or the number of adapters. Counting tests (work done), never timing ones."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest

from lorastar.engine.engine import LLMEngine
from lorastar.engine.sampling import SamplingParams


class _CountingDeque(deque):  # type: ignore[type-arg]
    """A deque that counts the items its iteration hands out."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.iterated = 0

    def __iter__(self) -> Iterator[Any]:
        for x in super().__iter__():
            self.iterated += 1
            yield x


def _count_adapter_infos(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], Any]:
    """Count the ``AdapterInfo``s built from now on (``[count]``), and the real class to put back."""
    import lorastar.adapters.registry as registry_mod

    built, real = [0], registry_mod.AdapterInfo

    def counting(*args: Any, **kwargs: Any) -> Any:
        built[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(registry_mod, "AdapterInfo", counting)
    return built, real


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Any) -> LLMEngine:
    from lorastar.config import EngineConfig

    return LLMEngine(EngineConfig.from_kwargs(model=tiny_model_dir("llama-gqa"), num_kv_blocks=64))


def _queue_work(engine: LLMEngine, n: int) -> int:
    """Items of the waiting queue read while ``n`` requests are queued under a max_waiting bound."""
    sched = engine.scheduler
    sched.waiting = waiting = _CountingDeque(sched.waiting)
    engine.config.max_waiting = 10 * n
    ids = []
    try:
        for _ in range(n):
            ids.append(engine.add_request([1, 2, 3], SamplingParams(max_tokens=1)).request_id)
        return waiting.iterated
    finally:
        engine.config.max_waiting = None
        for rid in ids:
            engine.abort_request(rid)
        sched.waiting = deque(sched.waiting)


def test_add_request_under_max_waiting_does_not_scan_the_queue(engine: LLMEngine) -> None:
    # Each add checked max_waiting by counting the whole queue: n adds read ~n^2/2 queue items
    # (5,000 queued requests: 12.5M reads under the engine's lock).
    small, large = _queue_work(engine, 100), _queue_work(engine, 200)
    assert large <= 2.2 * small + 200, (small, large)
    assert large <= 2 * 200, (small, large)


def _infos_per_resolve(engine: LLMEngine, num_adapters: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """``AdapterInfo``s built while the plugin resolves one request's adapter, ``num_adapters`` loaded."""
    import asyncio

    import lorastar.adapters.registry as registry_mod
    from lorastar.adapters.peft import LoRAWeights
    from lorastar.engine.async_engine import AsyncLLM
    from lorastar.plugin.config import LoraStarConfig
    from lorastar.plugin.service import LoraStarService

    reg = engine.registry
    names = [f"scale-{num_adapters}-{i}" for i in range(num_adapters)]
    for name in names:  # disk-tier-like identities: no tensors needed to list them
        reg.register(
            name,
            f"/a/{name}",
            LoRAWeights(f"/a/{name}", 8, 16.0, False, frozenset({"q_proj"}), f"h{name}", {}),
        )
    llm = AsyncLLM.__new__(AsyncLLM)  # the client over this engine, without building another
    llm.engine = engine
    service = LoraStarService(LoraStarConfig(async_engine=llm, served_model_name="base"))
    built, real = _count_adapter_infos(monkeypatch)
    try:
        assert asyncio.run(service.resolve_model(names[-1])) == names[-1]
    finally:
        monkeypatch.setattr(registry_mod, "AdapterInfo", real)
        for name in names:
            reg.unregister(name)
    return built[0]


def test_resolving_an_adapter_does_not_list_every_adapter(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each request naming an adapter built every loaded adapter's AdapterInfo (sorted) to test one
    # name: ~3.8 ms a request with 1,000 adapters, on the event loop, holding the registry's lock.
    small = _infos_per_resolve(engine, 100, monkeypatch)
    large = _infos_per_resolve(engine, 200, monkeypatch)
    assert large <= small + 2, (small, large)
    engine.registry.check_invariants()


def _backlog_work(k: int, monkeypatch: pytest.MonkeyPatch) -> tuple[int, Any]:
    """Token ids copied into joined outputs while a stream hands out a backlog of ``k`` DELTA outputs
    (one token each, logprobs on) at once, and what it handed out."""
    import asyncio

    import lorastar.engine.streams as streams
    from lorastar.engine.outputs import CompletionOutput, Logprob, RequestOutput

    copied = 0
    real = streams.CompletionOutput

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal copied
        out = real(*args, **kwargs)
        copied += len(out.token_ids)
        return out

    def step(i: int) -> RequestOutput:
        lp = [{i: Logprob(-0.5, 1, "x")}]
        return RequestOutput(
            "r", None, [1], [CompletionOutput(0, f"t{i} ", [i], -0.5 * (i + 1), lp)], i == k - 1
        )

    async def drain() -> list[RequestOutput]:
        q: asyncio.Queue[Any] = asyncio.Queue()
        for i in range(k):
            q.put_nowait(step(i))
        return [o async for o in streams.stream_outputs(q, True, lambda: None)]

    monkeypatch.setattr(streams, "CompletionOutput", counting)
    try:
        outs = asyncio.run(drain())
    finally:
        monkeypatch.setattr(streams, "CompletionOutput", real)
    return copied, outs


def test_stream_backlog_is_joined_in_linear_work(monkeypatch: pytest.MonkeyPatch) -> None:
    # A reader k steps behind (a slow client) got its backlog joined pairwise: each join copied the
    # text, ids and logprobs joined so far, ~k^2/2 token ids for k outputs.
    small, outs = _backlog_work(500, monkeypatch)
    large, _ = _backlog_work(1000, monkeypatch)
    assert large <= 2.2 * small + 10, (small, large)
    assert large <= 2 * 1000, (small, large)
    # the same joined output as before: one that covers the whole backlog
    assert len(outs) == 1 and outs[0].finished
    (o,) = outs[0].outputs
    assert o.text == "".join(f"t{i} " for i in range(500))
    assert o.token_ids == list(range(500))
    assert o.logprobs is not None and [next(iter(e)) for e in o.logprobs] == list(range(500))
    assert o.cumulative_logprob == -0.5 * 500


def test_backlog_join_equals_pairwise_merges() -> None:
    import functools
    import random

    from lorastar.engine.outputs import CompletionOutput, Logprob, RequestOutput
    from lorastar.engine.streams import _merge_run, merge_deltas

    rng = random.Random(0)
    for _ in range(200):
        outs = []
        for s in range(rng.randint(2, 6)):
            choices = [
                CompletionOutput(
                    i,
                    f"{s}.{i}",
                    [rng.randint(0, 9) for _ in range(rng.randint(0, 2))],
                    rng.random(),
                    None if rng.random() < 0.3 else [{s: Logprob(-1.0)}],
                    rng.choice([None, "stop"]),
                    rng.choice([None, 7]),
                )
                for i in rng.sample(range(3), rng.randint(1, 3))
            ]
            pl = rng.choice([None, [], [None, {1: Logprob(-2.0)}]])
            outs.append(RequestOutput("r", "p", [1], choices, rng.random() < 0.5, "a", s, pl, None))
        assert _merge_run(outs[0], outs[1:]) == functools.reduce(merge_deltas, outs)


def _prompt_decodes(max_tokens: int) -> int:
    """Whole-prompt decodes while a streamed completion echoes an ids prompt with logprobs."""
    import sys
    from pathlib import Path

    from litestar.testing import TestClient

    sys.path.insert(0, str(Path(__file__).parents[1] / "plugin"))
    from plugin_fake_engine import FakeAsyncLLM

    from lorastar.plugin import LoraStarConfig, create_app

    engine = FakeAsyncLLM(step_delay=0.0, max_model_len=4096)
    prompt = [ord("a") + i % 26 for i in range(300)]
    whole = 0
    real = engine.tokenizer.decode

    def counting(ids: list[int], **kw: Any) -> str:
        nonlocal whole
        whole += len(ids) == len(prompt)
        return real(ids, **kw)

    engine.tokenizer.decode = counting  # type: ignore[method-assign]
    body = {"prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": 1, "stream": True}
    with TestClient(create_app(LoraStarConfig(async_engine=engine))) as client:
        resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n"), resp.text[-300:]
    assert resp.text.count("data: {") >= max_tokens
    return whole


def test_streamed_echo_decodes_an_ids_prompt_once() -> None:
    # Each chunk of an echoed, streamed completion with logprobs decoded the whole ids prompt again
    # (for its text_offset): prompt length x output length.
    small, large = _prompt_decodes(10), _prompt_decodes(40)
    assert large <= small <= 2, (small, large)


def test_engine_stats_do_not_build_every_adapters_info(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # stats() (every 0.1 s in a core process, each /metrics scrape) built each adapter's full,
    # sorted AdapterInfo for its name -> tier map: ~3.8 ms with 1,000 adapters.
    import lorastar.adapters.registry as registry_mod
    from lorastar.adapters.peft import LoRAWeights

    reg = engine.registry
    names = [f"stats-{i}" for i in range(50)]
    for name in names:
        reg.register(
            name,
            f"/a/{name}",
            LoRAWeights(f"/a/{name}", 8, 16.0, False, frozenset({"q_proj"}), f"s{name}", {}),
        )
    built, real = _count_adapter_infos(monkeypatch)
    try:
        tiers = engine.stats().adapter_tiers
    finally:
        monkeypatch.setattr(registry_mod, "AdapterInfo", real)
        for name in names:
            reg.unregister(name)
    assert built[0] == 0
    assert tiers == {n: "cpu" for n in names}
    assert list(tiers) == sorted(tiers)
