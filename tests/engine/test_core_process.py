"""The engine core in its own process (engine/core_proc.py) behind ``AsyncCoreClient``.

The reference is the in-process engine on the same config (itself held to HF and PEFT by the
parity tests): what crosses the process boundary must arrive unchanged, token for token, text,
logprobs and finish reasons; errors arrive as the same exception types; aborts and failures leave
no blocks held; a killed core is replaced and its adapters come back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from lorastar import LLM
from lorastar.config import EngineConfig
from lorastar.engine.core_client import AsyncCoreClient
from lorastar.engine.sampling import RequestOutputKind, SamplingParams
from lorastar.errors import (
    AdapterNotFoundError,
    EngineDeadError,
    EngineUnavailableError,
    InvalidParamError,
    LimitExceededError,
    RequestFailedError,
)
from tests.conftest import make_peft_adapter


def _config(model: str | None = None, **kw: Any) -> EngineConfig:
    """SmolLM2 (``None``) where tokens are compared: a random tiny model's near-flat logits tie
    often enough that two batch shapes may pick different greedy tokens. (``cpu_gemm="auto"`` once
    raced oneDNN against torch's GEMM on every start and took the faster; where they were close, a
    core process and the in-process engine ran different GEMMs, which round differently, and this
    file's adapter test flipped on a near tie. ``layers/cpu_gemm.pick`` now keeps oneDNN unless torch
    is clearly faster.)"""
    opts: dict[str, Any] = dict(model=model, device="cpu", dtype="float32", max_model_len=256,
                                num_kv_blocks=256, max_num_seqs=16, max_loras=2, max_cpu_loras=4, seed=0)  # fmt: skip
    opts.update(kw)
    return EngineConfig(**opts)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Any) -> str:
    return tiny_model_dir("llama-gqa")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> str:
    from lorastar.models.default import default_model_dir

    return make_peft_adapter(default_model_dir(), tmp_path_factory.mktemp("ad"), seed=3, r=8, scale=0.5)


@pytest.fixture(scope="module")
def client() -> Iterator[AsyncCoreClient]:
    c = AsyncCoreClient(_config())
    yield c
    asyncio.run(c.shutdown(drain_timeout=0))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**vars(_config()))


async def _collect(c: Any, prompt: Any, sp: SamplingParams, **kw: Any) -> list[Any]:
    return [o async for o in c.generate(prompt, sp, **kw)]


PROMPTS = ["The capital of France is", "One, two, three,", "def fib(n):"]


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True),
        SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop=["e"], ignore_eos=True),
        SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(
            temperature=0.8, seed=2, max_tokens=8, allowed_token_ids=[13, 28, 30, 253, 314], ignore_eos=True
        ),
        SamplingParams(
            temperature=0.0, max_tokens=20, bad_words=["Paris", "the", "four five"], ignore_eos=True
        ),
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8, guided_choice=["Paris", "a city", "a"]),
        SamplingParams(
            n=2,
            temperature=1.0,
            seed=5,
            max_tokens=12,
            guided_json={"type": "object", "properties": {"a": {"type": "integer"}}},
        ),
    ],
    ids=[
        "greedy",
        "logprobs",
        "n3-seeded",
        "stop-string",
        "beam",
        "prompt-logprobs",
        "allowed-ids",
        "bad-words",
        "choice",
        "json-schema",
    ],
)
async def test_outputs_equal_the_in_process_engine(
    client: AsyncCoreClient, llm: LLM, sp: SamplingParams
) -> None:
    ref = llm.generate(PROMPTS, sp)
    got = await asyncio.gather(*(_collect(client, p, sp) for p in PROMPTS))
    for r, outs in zip(ref, got):
        final = outs[-1]
        assert final.finished and sum(o.finished for o in outs) == 1
        assert final.prompt == r.prompt and final.prompt_token_ids == r.prompt_token_ids
        assert [(o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in final.outputs] == [
            (o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in r.outputs
        ]
        if sp.prompt_logprobs is not None:
            assert final.prompt_logprobs is not None and final.prompt_logprobs[0] is None
            assert [
                None if d is None else {t: (v.rank, v.decoded_token) for t, v in d.items()}
                for d in final.prompt_logprobs
            ] == [
                None if d is None else {t: (v.rank, v.decoded_token) for t, v in d.items()}
                for d in r.prompt_logprobs
            ]
        if sp.logprobs is not None:  # same ranks and tokens; values as close as two batch shapes allow
            for mine, theirs in zip(final.outputs[0].logprobs, r.outputs[0].logprobs, strict=True):
                assert {t: (v.rank, v.decoded_token) for t, v in mine.items()} == {
                    t: (v.rank, v.decoded_token) for t, v in theirs.items()
                }
                assert all(abs(v.logprob - theirs[t].logprob) < 1e-4 for t, v in mine.items())


async def test_delta_stream_joins_to_the_final_text(client: AsyncCoreClient, llm: LLM) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    ref = llm.generate([PROMPTS[0]], sp)[0].outputs[0]
    outs = await _collect(client, PROMPTS[0], sp)
    assert len(outs) > 1  # streamed, not one final output
    assert "".join(o.outputs[0].text for o in outs) == ref.text
    assert [t for o in outs for t in o.outputs[0].token_ids] == ref.token_ids
    final_only = dict(vars(sp), output_kind=RequestOutputKind.FINAL_ONLY)
    outs = await _collect(client, PROMPTS[0], SamplingParams(**final_only))
    assert len(outs) == 1 and outs[0].outputs[0].text == ref.text


async def test_errors_cross_the_boundary_with_their_type_and_param(client: AsyncCoreClient) -> None:
    with pytest.raises(LimitExceededError) as e:
        await _collect(client, "hi", SamplingParams(n=10_000))
    assert e.value.param == "n"
    with pytest.raises(LimitExceededError) as e:  # the core's limit, checked where it tokenizes them
        await _collect(client, "hi", SamplingParams(bad_words=[f"w{i}" for i in range(10_000)]))
    assert e.value.param == "bad_words"
    with pytest.raises(AdapterNotFoundError, match="nope"):
        await _collect(client, "hi", SamplingParams(), adapter="nope")
    with pytest.raises(InvalidParamError) as e:  # checked in the frontend, never sent
        await _collect(client, [10**9], SamplingParams())
    assert e.value.param == "prompt"
    with pytest.raises(ValueError, match="already in use"):
        gen = client.generate("hi", SamplingParams(max_tokens=50, ignore_eos=True), request_id="dup")
        await gen.__anext__()
        await _collect(client, "hi", SamplingParams(), request_id="dup")
    await gen.aclose()


async def test_a_slow_grammar_compiles_off_the_step_loop(client: AsyncCoreClient) -> None:
    """A schema that takes long to compile (a string's maxLength of a million: 1.4 s on the dev VM)
    holds back only its own request: a request sent after it ends first. One aborted while it
    compiles never runs; a regex the core cannot compile is that request's InvalidParamError."""
    order: list[str] = []

    async def run(tag: str, sp: SamplingParams) -> None:
        await _collect(client, "hi", sp)
        order.append(tag)

    slow = SamplingParams(max_tokens=4, guided_json={"type": "string", "maxLength": 10**6 + 1})
    await asyncio.gather(run("slow", slow), run("plain", SamplingParams(max_tokens=4)))
    assert order == ["plain", "slow"]
    long = SamplingParams(
        max_tokens=200, ignore_eos=True, guided_json={"type": "string", "maxLength": 10**6 + 2}
    )
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(_collect(client, "hi", long), 0.3)  # cancelled while compiling: aborted
    await asyncio.sleep(3.0)  # past its compile: it would be running now had it been queued
    s = client.stats()
    assert s.num_running == 0 and s.num_waiting == 0 and s.num_used_blocks == 0
    with pytest.raises(InvalidParamError) as e:  # this client checks no grammar: the core's compile does
        await _collect(client, "hi", SamplingParams(guided_regex="(["))
    assert e.value.param == "guided_regex" and "Unclosed" in str(e.value)


def _wait(predicate: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


async def test_closing_a_stream_aborts_and_frees_its_blocks(client: AsyncCoreClient) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    gens = [client.generate(p, sp) for p in PROMPTS]
    for g in gens:
        await g.__anext__()
    # counters arrive with each finish and every STATE_EVERY_S while the core steps
    assert await asyncio.to_thread(_wait, lambda: client.stats().num_running == 3)
    for g in gens:
        await g.aclose()
    await asyncio.to_thread(_wait, lambda: (s := client.stats()) is not None and s.num_running == 0)
    s = client.stats()
    assert s.num_running == 0 and s.num_waiting == 0 and s.num_used_blocks == 0


async def test_a_stop_string_found_in_the_frontend_finishes_the_sample_in_the_core(
    client: AsyncCoreClient, llm: LLM
) -> None:
    """The frontend detokenizes; on a stop string it ends the output at once and tells the core
    (FinishSamples), which stops computing the sample and frees its blocks long before the
    max_tokens it would otherwise run to; with n = 2 the other sample runs on."""
    stop = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    word = stop.outputs[0].text.split()[-1]  # a word the greedy output reaches within 6 tokens
    sp = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True, stop=[word])
    (final,) = [o for o in await _collect(client, PROMPTS[1], sp) if o.finished]
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == word
    assert len(final.outputs[0].token_ids) <= 6
    assert await asyncio.to_thread(
        _wait, lambda: (s := client.stats()) is not None and s.num_running == 0 and s.num_used_blocks == 0
    )
    gen_before = client.stats().generation_tokens_total  # type: ignore[union-attr]
    # n = 2, seeded: one sample may stop early, the other is cut by max_tokens; both as in-process.
    sp2 = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=40, ignore_eos=True, stop=[" the"])
    ref = llm.generate([PROMPTS[0]], sp2)[0]
    (got,) = [o for o in await _collect(client, PROMPTS[0], sp2) if o.finished]
    assert [(o.text, o.token_ids, o.finish_reason) for o in got.outputs] == [
        (o.text, o.token_ids, o.finish_reason) for o in ref.outputs
    ]
    assert await asyncio.to_thread(_wait, lambda: client.stats().num_used_blocks == 0)  # type: ignore[union-attr]
    # The core generated at most a step or two past what the outputs show.
    produced = sum(len(o.token_ids) for o in got.outputs)
    assert client.stats().generation_tokens_total - gen_before <= produced + 4  # type: ignore[union-attr]


async def test_adapters_load_serve_and_unload_through_the_core(
    client: AsyncCoreClient, llm: LLM, adapter: str
) -> None:
    info = await client.load_adapter("ad", adapter)
    assert info.name == "ad" and info.rank == 8
    assert [a.name for a in client.list_adapters()] == ["ad"]  # visible as soon as the load returns
    llm.load_adapter("ad", adapter)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    try:
        # One request at a time on both sides, so both run the same batch shapes: the GEMM's
        # rounding follows the batch, and this random adapter leaves near ties that a different
        # batching can flip (not a fault; the concurrent round below checks the rest).
        ref = [llm.generate([p], sp, adapter="ad")[0] for p in PROMPTS]
        base = llm.generate(PROMPTS, sp)
        got = [await _collect(client, p, sp, adapter="ad") for p in PROMPTS]
        assert [g[-1].outputs[0].token_ids for g in got] == [r.outputs[0].token_ids for r in ref]
        assert [r.outputs[0].token_ids for r in ref] != [b.outputs[0].token_ids for b in base]
        assert got[0][-1].adapter == "ad"
        together = await asyncio.gather(*(_collect(client, p, sp, adapter="ad") for p in PROMPTS))
        assert all(len(g[-1].outputs[0].token_ids) == 16 and g[-1].adapter == "ad" for g in together)
        assert client.stats().adapter_generation_tokens["ad"] >= 6 * 16  # counters as of the finish
    finally:
        llm.unload_adapter("ad")
        await client.unload_adapter("ad")
    assert client.list_adapters() == []
    with pytest.raises(AdapterNotFoundError):
        await client.unload_adapter("ad")


async def test_a_killed_core_fails_open_requests_and_is_replaced(adapter: str) -> None:
    c = await asyncio.to_thread(AsyncCoreClient, _config())
    try:
        await c.load_adapter("ad", adapter)
        sp = SamplingParams(
            temperature=0.0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        gen = c.generate("hello", sp, adapter="ad")
        await gen.__anext__()
        pid = c.core_pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RequestFailedError, match="exited"):
            async for _ in gen:
                pass
        assert await asyncio.to_thread(_wait, lambda: c.restarting, 10)
        with pytest.raises(EngineUnavailableError):  # 503 + Retry-After while it restarts
            await _collect(c, "hi", SamplingParams())
        assert await asyncio.to_thread(_wait, lambda: not c.restarting, 120)
        assert c.core_pid != pid and c.num_restarts == 1
        assert [a.name for a in c.list_adapters()] == ["ad"]  # loaded again by name and path
        outs = await _collect(c, "hello", SamplingParams(temperature=0.0, max_tokens=4), adapter="ad")
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    finally:
        await c.shutdown(drain_timeout=0)
    assert c.core_pid is not None and _wait(lambda: _gone(c.core_pid), 10)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_shutdown_drains_in_flight_requests(model: str) -> None:
    c = await asyncio.to_thread(AsyncCoreClient, _config(model))
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    gen = c.generate("hello", sp)
    first = await gen.__anext__()
    await c.shutdown(drain_timeout=60)
    rest = [o async for o in gen]
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "length"
    assert sum(len(o.outputs[0].token_ids) for o in [first, *rest]) == 40
    assert _gone(c.core_pid)
    with pytest.raises(EngineDeadError):
        await _collect(c, "hi", SamplingParams())


async def test_two_clients_share_one_core(llm: LLM, tmp_path: Any) -> None:
    """``lorastar engine`` serves several frontends (app workers): each gets its own outputs."""
    cfg = _config()
    address = f"ipc://{tmp_path}/core"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lorastar.plugin.cli", "engine", "--address", address, "--device", "cpu",
         "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "256", "--max-num-seqs", "16",
         "--max-waiting", "7"],
    )  # fmt: skip
    try:
        a = await asyncio.to_thread(AsyncCoreClient, cfg, address=address, start_timeout=120)
        b = await asyncio.to_thread(AsyncCoreClient, cfg, address=address, start_timeout=120)
        # the core's settings, not the frontend's config (the HTTP layer bounds a prompt batch by it)
        assert (cfg.max_waiting, a.max_waiting, b.max_waiting) == (None, 7, 7)
        sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        ra, rb = await asyncio.gather(_collect(a, PROMPTS[0], sp), _collect(b, PROMPTS[1], sp))
        ref = llm.generate(PROMPTS[:2], sp)
        assert ra[-1].outputs[0].token_ids == ref[0].outputs[0].token_ids
        assert rb[-1].outputs[0].token_ids == ref[1].outputs[0].token_ids
        # a worker leaving aborts its own requests only
        long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)  # outlives a's shutdown
        ga = a.generate(PROMPTS[0], long)
        await ga.__anext__()
        tb = asyncio.ensure_future(_collect(b, PROMPTS[1], long))
        await a.shutdown(drain_timeout=0)
        assert (await tb)[-1].outputs[0].finish_reason == "length"
        assert proc.poll() is None  # the shared core keeps running
        await b.shutdown(drain_timeout=0)
    finally:
        proc.terminate()
        proc.wait(30)


def test_engine_command_refuses_a_bad_address_before_loading() -> None:
    from click.testing import CliRunner

    from lorastar.plugin.cli import main

    r = CliRunner().invoke(main, ["engine", "--address", "localhost:5555"])
    assert r.exit_code == 2 and "--address must start with tcp:// or ipc://" in r.output
    r = CliRunner().invoke(main, ["engine", "--address", "tcp://0.0.0.0:5555"])
    assert r.exit_code == 2 and "no authentication" in r.output


async def test_a_malformed_message_does_not_stop_the_core(client: AsyncCoreClient) -> None:
    client._send({"type": "AddRequest", "client_id": 1})  # wrong shape: dropped and logged
    client._send([1, 2, 3])
    outs = await _collect(client, "hi", SamplingParams(temperature=0.0, max_tokens=3))
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3


async def test_a_failed_step_in_the_core_fails_its_requests_and_the_core_rebuilds(
    model: str, tmp_path: Any
) -> None:
    """The core's own recovery (``rebuild_engine``, as in ``AsyncLLM``): the step's request gets
    ``RequestFailedError`` at once, the engine is rebuilt, the next request is served."""
    import threading

    from lorastar.engine.core_proc import EngineCoreProc

    address = f"ipc://{tmp_path}/core"
    core = await asyncio.to_thread(EngineCoreProc, _config(model), address)

    def boom(*_: Any) -> Any:
        raise RuntimeError("injected forward failure")

    core.engine.runner.execute = boom  # type: ignore[method-assign]  # the rebuilt engine runs normally
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    c = await asyncio.to_thread(AsyncCoreClient, _config(model), address=address, start_timeout=60)
    try:
        with pytest.raises(RequestFailedError):
            await _collect(c, "hello", SamplingParams(max_tokens=4))
        assert await asyncio.to_thread(_wait, lambda: c.num_restarts == 1 and not c.restarting, 60)
        outs = await _collect(c, "hello", SamplingParams(temperature=0.0, max_tokens=4))
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    finally:
        await c.shutdown(drain_timeout=0)
        core.stop.set()
        await asyncio.to_thread(thread.join, 10)
    assert not thread.is_alive()


def _core_tokens(engine: Any, prompt: list[int], sp: SamplingParams) -> list[int]:
    """Greedy ids of one request run through ``step_core`` alone (what a core process does)."""
    req = engine.add_core_request(prompt, sp)
    ids: list[int] = []
    while engine.has_unfinished():
        for out in engine.step_core():
            if out.request_id == req.request_id:
                ids += out.samples[0].token_ids
    return ids


def test_a_core_loads_no_tokenizer_until_words_need_one(llm: LLM) -> None:
    """A core's engine starts without its tokenizer (``lazy_tokenizer``, the core process's mode:
    transformers' import and the tokenizer took most of its start) and serves token ids without
    it; the first ``bad_words`` request loads it, and its tokens equal the eager engine's."""
    from lorastar.engine.engine import LLMEngine

    engine = LLMEngine(_config(), lazy_tokenizer=True)
    try:
        assert not engine.tokenizer_loader.loaded
        assert engine.eos_token_ids == llm.engine.eos_token_ids  # from generation_config.json
        prompt = llm.engine.tokenize("The capital of France is")
        plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        assert _core_tokens(engine, prompt, plain) == _core_tokens(llm.engine, prompt, plain)
        assert not engine.tokenizer_loader.loaded
        banned = _core_tokens(llm.engine, prompt, plain)[0]
        words = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                               bad_words=[llm.engine.tokenizer.decode([banned]).strip()])  # fmt: skip
        got = _core_tokens(engine, prompt, words)
        assert engine.tokenizer_loader.loaded
        assert got == _core_tokens(llm.engine, prompt, words) and got[0] != banned
    finally:
        engine.close()


def test_a_tokenizer_the_frontend_cannot_load_fails_the_start_and_ends_the_core(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spawned core starts without a tokenizer, so a folder holding none fails in the
    frontend's load, which raises from the client's start and leaves no core process behind."""
    from lorastar.engine import core_client

    spawned: list[subprocess.Popen[bytes]] = []
    popen = subprocess.Popen

    def record(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        spawned.append(popen(*args, **kwargs))
        return spawned[-1]

    monkeypatch.setattr(core_client.subprocess, "Popen", record)
    with pytest.raises((OSError, ValueError)):
        AsyncCoreClient(_config(tokenizer=str(tmp_path)))
    assert len(spawned) == 1
    assert spawned[0].wait(timeout=30) is not None


def test_a_shared_core_loads_its_tokenizer_before_serving(tmp_path: Any) -> None:
    """``lorastar engine`` (no parent to report to) fails its own start on a tokenizer folder it
    cannot load, rather than starting and failing every client's."""
    from lorastar.engine.core_proc import EngineCoreProc

    with pytest.raises((OSError, ValueError)):
        EngineCoreProc(_config(tokenizer=str(tmp_path)), f"ipc://{tmp_path}/core")
