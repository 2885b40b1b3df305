"""The engine core process and its clients when something goes wrong (engine/core_proc.py,
engine/core_client.py): a request that cannot be encoded, an abort while its grammar compiles, a
shared core that dies, a client that dies without a ``Goodbye``, a full input pipe.

The core runs on a thread of this process (``EngineCoreProc.run``, as ``lorastar engine`` runs it)
so that a test can stop it, replace it and look inside it; its clients talk to it over ipc.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from lorastar.config import EngineConfig
from lorastar.engine import core_client, core_proc
from lorastar.engine.core_client import AsyncCoreClient
from lorastar.engine.core_proc import EngineCoreProc
from lorastar.engine.messages import AddRequest, Hello, Ready, encoder, input_decoder, output_decoder
from lorastar.engine.sampling import RequestOutputKind, SamplingParams
from lorastar.errors import EngineUnavailableError, InvalidParamError, RequestFailedError
from tests.conftest import make_peft_adapter


def _config(model: str, **kw: Any) -> EngineConfig:
    opts: dict[str, Any] = dict(model=model, device="cpu", dtype="float32", max_model_len=256,
                                num_kv_blocks=256, max_num_seqs=16, max_loras=2, max_cpu_loras=4, seed=0)  # fmt: skip
    opts.update(kw)
    return EngineConfig(**opts)


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


@pytest.fixture(scope="module")
def model(tiny_model_dir: Any) -> str:
    return tiny_model_dir("llama-gqa")


@pytest.fixture
def address(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/core"


@pytest.fixture
def core(model: str, address: str) -> Iterator[_Core]:
    c = _Core(_config(model), address)
    yield c
    if c.thread.is_alive():
        c.stop()


async def _client(address: str, **kw: Any) -> AsyncCoreClient:
    return await asyncio.to_thread(AsyncCoreClient, address=address, start_timeout=60, **kw)


async def _collect(c: AsyncCoreClient, prompt: Any, sp: SamplingParams, **kw: Any) -> list[Any]:
    return [o async for o in c.generate(prompt, sp, **kw)]


def _wait(predicate: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


async def test_a_request_msgspec_cannot_encode_is_a_400_and_leaves_nothing_registered(
    core: _Core, address: str
) -> None:
    """A lone surrogate (a legal Python str) or an int past 64 bits cannot cross to the core: the
    caller gets InvalidParamError (a ValueError: 400) naming the field, the id stays free."""
    c = await _client(address)
    try:
        with pytest.raises(InvalidParamError, match="cannot be sent") as e:
            await _collect(c, "hi", SamplingParams(max_tokens=2), request_id="bad\ud800")
        assert e.value.param == "request_id" and not c.has_unfinished()
        # past SamplingParams' own checks (they bound these): what the client guarantees anyway
        for field, value in (("allowed_token_ids", [2**64]), ("stop", ["\ud800"])):
            sp = SamplingParams(max_tokens=2)
            setattr(sp, field, value)
            with pytest.raises(InvalidParamError) as e:
                await _collect(c, "hi", sp, request_id="r1")
            assert e.value.param == field and not c.has_unfinished()
        outs = await _collect(c, "hi", SamplingParams(max_tokens=2), request_id="r1")  # the id is free
        assert outs[-1].finished and not c.has_unfinished()
    finally:
        await c.shutdown(drain_timeout=0)


async def test_an_abort_while_the_grammar_compiles_ends_the_stream_as_aborted(
    core: _Core, address: str
) -> None:
    """The core compiles a grammar off its loop; an Abort that finds the request still compiling
    ends its stream as one for a running request does: n samples, finish_reason "abort"."""
    c = await _client(address)
    try:
        # a schema not compiled before in this process (the compile is cached); the Abort follows the
        # AddRequest at once, so it reaches the core while the grammar compiles
        sp = SamplingParams(n=2, max_tokens=4, guided_json={"type": "string", "maxLength": 10**5 + 17})
        task = asyncio.ensure_future(_collect(c, "hi", sp, request_id="g"))
        while "g" not in c._open:  # registered (its stream is keyed by its wire id)
            await asyncio.sleep(0.001)
        await c.abort("g")
        outs = await asyncio.wait_for(task, 15)
        assert outs[-1].finished and len(outs[-1].outputs) == 2
        assert [o.finish_reason for o in outs[-1].outputs] == ["abort", "abort"]
        assert not c.has_unfinished()
        core.proc.grammar_pool.submit(lambda: None).result(60)  # its compile is over
        await asyncio.sleep(0.3)  # and the core's loop has seen it: it was not queued
        assert not core.proc.engine.requests and not core.proc.compiling
    finally:
        await c.shutdown(drain_timeout=0)


async def test_a_dead_shared_core_fails_open_requests_and_calls_and_a_new_one_serves(
    model: str, core: _Core, address: str
) -> None:
    """Silent past ``dead_timeout``, a shared core is taken for dead: the open stream and the
    adapter load waiting for its reply fail (RequestFailedError, not a hang). The client keeps
    saying Hello: a core started again at the address serves new requests."""
    c = await _client(address)
    c.dead_timeout = 2.0  # DEAD_S is 30
    try:
        loading = threading.Event()
        core.proc.engine.load_adapter = lambda *a, **k: loading.wait(60)  # type: ignore[method-assign]
        sp = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        gen = c.generate("hello", sp)
        await gen.__anext__()
        call = asyncio.ensure_future(c.load_adapter("ad", "/nowhere"))
        assert await asyncio.to_thread(_wait, lambda: bool(core.proc.jobs), 10)
        core.stop()  # dies (a SIGKILL'd `lorastar engine` is as silent)
        loading.set()

        async def rest() -> None:
            async for _ in gen:
                pass

        with pytest.raises(RequestFailedError, match="not answered"):
            await asyncio.wait_for(rest(), 15)
        with pytest.raises(RequestFailedError):
            await asyncio.wait_for(call, 15)
        assert not c.has_unfinished() and c.restarting
        with pytest.raises(EngineUnavailableError):  # 503 meanwhile
            await _collect(c, "hi", SamplingParams(max_tokens=2))
        again = await asyncio.to_thread(_Core, _config(model), address)
        try:
            assert await asyncio.to_thread(_wait, lambda: not c.restarting, 30)
            outs = await _collect(c, "hi", SamplingParams(max_tokens=3, ignore_eos=True))
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        finally:
            await c.shutdown(drain_timeout=0)
            again.stop()
    finally:
        await c.shutdown(drain_timeout=0)  # (a no-op once shut down)


def _fake_client(ctx: zmq.Context, tmp: Path, core_address: str, client_id: str) -> tuple[Any, Any, Ready]:
    """A client's two sockets, by hand; its Hello answered."""
    out = ctx.socket(zmq.PULL)
    out.bind(f"ipc://{tmp}/out-{uuid.uuid4().hex[:8]}")
    inp = ctx.socket(zmq.PUSH)
    inp.setsockopt(zmq.LINGER, 0)
    inp.connect(core_address)
    inp.send(encoder().encode(Hello(client_id, out.getsockopt_string(zmq.LAST_ENDPOINT))))
    assert out.poll(30_000)
    ready = output_decoder().decode(out.recv())
    assert isinstance(ready, Ready)
    return inp, out, ready


async def test_a_client_killed_without_goodbye_does_not_block_the_shared_core(
    model: str, address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frontend killed (kill -9) leaves its requests running and its output pipe filling; at
    ``CLIENT_HWM`` queued messages the core drops it as if it had said Goodbye (its requests
    aborted) instead of blocking its only thread, and another client is served. Back with a
    Hello, it is told that the core no longer knew it."""
    monkeypatch.setattr(core_proc, "CLIENT_HWM", 20, raising=False)  # small: filled in 20 steps
    core = _Core(_config(model, max_num_seqs=1), address)  # one at a time: the good one waits
    ctx = zmq.Context()
    good: AsyncCoreClient | None = None
    try:
        good = await _client(address)
        dead = uuid.uuid4().hex
        inp, out, _ = _fake_client(ctx, tmp_path, address, dead)
        sp = SamplingParams(max_tokens=200, ignore_eos=True)
        for i in range(8):  # 8 x 200 steps, one Outputs message each to this client
            inp.send(encoder().encode(AddRequest(dead, f"dead-{i}", [1, 2, 3], sp)))
        assert await asyncio.to_thread(_wait, lambda: "dead-0" in core.proc.engine.requests, 30)
        out.close(linger=0)  # killed: no Goodbye
        inp.close(linger=0)
        outs = await asyncio.wait_for(_collect(good, [1, 2, 3], SamplingParams(max_tokens=2)), 20)
        assert outs[-1].finished
        assert dead not in core.proc.clients and dead not in core.proc.owner.values()
        assert not any(r.startswith("dead-") for r in list(core.proc.engine.requests))
        inp, out, ready = _fake_client(ctx, tmp_path, address, dead)  # the same id says Hello again
        assert not ready.known_client
        inp.send(encoder().encode(Hello(dead, out.getsockopt_string(zmq.LAST_ENDPOINT))))
        assert out.poll(30_000)
        msg = output_decoder().decode(out.recv())
        while not isinstance(msg, Ready):  # a State may come first
            assert out.poll(30_000)
            msg = output_decoder().decode(out.recv())
        assert msg.known_client
        out.close(linger=0)
        inp.close(linger=0)
    finally:
        if good is not None:
            await good.shutdown(drain_timeout=0)
        core.stop()
        ctx.term()


async def test_sends_to_a_core_that_does_not_read_never_block_the_event_loop(
    core: _Core, address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the core gone, 3000 aborts (one per closed stream, what the HTTP layer sends; zmq's
    default pipe holds 1000) never block the event loop: the client queues them. Once the core is
    taken for dead, a request is refused (503) and left unregistered."""
    monkeypatch.setattr(core_client, "STALE_S", 1000.0)  # not stale yet: the sends are tried
    c = await _client(address)
    c.dead_timeout = 1000.0
    sender: threading.Thread | None = None
    try:
        core.stop()

        def aborts() -> None:  # on a thread: a send that blocks would block it, not this test
            async def run() -> None:
                for i in range(3000):
                    await c.abort(f"x{i}")

            asyncio.run(run())

        sender = threading.Thread(target=aborts, daemon=True)
        sender.start()
        await asyncio.to_thread(sender.join, 20)
        assert not sender.is_alive(), "a send to the gone core blocked"
        c.dead_timeout = 0.5  # refused (503), or failed once the deadline passes
        with pytest.raises((EngineUnavailableError, RequestFailedError)):
            await asyncio.wait_for(_collect(c, [1, 2, 3], SamplingParams(max_tokens=2)), 10)
        assert not c.has_unfinished()
        with pytest.raises((EngineUnavailableError, RequestFailedError)):
            await asyncio.wait_for(c.load_adapter("ad", "/nowhere"), 10)
        assert not c._calls
    finally:
        if sender is None or not sender.is_alive():  # (a blocked one holds the send lock)
            await c.shutdown(drain_timeout=0)


_FRESH_CLIENT = """
import asyncio, sys
from lorastar.engine.core_client import AsyncCoreClient
assert "transformers" not in sys.modules  # the bug needs transformers' first import
c = AsyncCoreClient(address=sys.argv[1], start_timeout=60)
print("started", c.model_name)
asyncio.run(c.shutdown(drain_timeout=0))
"""


def test_a_client_of_a_core_already_ready_starts_in_a_fresh_interpreter(core: _Core, address: str) -> None:
    """Against a ready core Ready comes at once, while the client's background import of
    transformers still runs: load_tokenizer's own import must not race it (transformers' lazy
    module failed with "cannot import name 'AutoTokenizer'"). A fresh interpreter each time:
    the race needs transformers' first import."""
    for _ in range(2):
        r = subprocess.run(
            [sys.executable, "-c", _FRESH_CLIENT, address], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0 and "started" in r.stdout, r.stderr[-3000:]


async def test_a_client_of_an_address_where_no_core_runs_fails_naming_it(address: str) -> None:
    """Nothing accepting a connection for ``connect_timeout``: a one-line error naming the address
    (it waited start_timeout, 900 s, silently)."""
    t = time.monotonic()
    with pytest.raises(ConnectionError, match=f"no engine core at {re.escape(address)}"):
        await asyncio.to_thread(AsyncCoreClient, address=address, connect_timeout=1.0)
    assert time.monotonic() - t < 10


def test_a_core_that_accepts_but_has_not_answered_is_waited_for_and_logged(
    address: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A core loading its model has bound its address (connections are accepted) but answers Hello
    only once loaded: the client waits past ``connect_timeout``, up to ``start_timeout``, saying so."""
    monkeypatch.setattr(core_client, "WAIT_LOG_S", 0.3)
    ctx = zmq.Context()
    loading = ctx.socket(zmq.PULL)
    loading.bind(address)
    try:
        with (
            caplog.at_level(logging.WARNING, "lorastar"),
            pytest.raises(TimeoutError, match=re.escape(address)),
        ):
            AsyncCoreClient(address=address, connect_timeout=0.5, start_timeout=2.0)
        assert f"waiting for the engine core at {address} (connected" in caplog.text
        assert isinstance(input_decoder().decode(loading.recv(zmq.NOBLOCK)), Hello)
    finally:
        loading.close(linger=0)
        ctx.term()


def test_a_client_waiting_for_its_core_can_be_stopped(address: str) -> None:
    """``cancel_startup()`` (a signal handler's, while an app's startup waits on a thread) ends the
    wait within a poll; on the main thread a signal interrupts it."""
    errors: list[BaseException] = []

    def build() -> None:
        try:
            AsyncCoreClient(address=address)
        except BaseException as exc:  # noqa: BLE001 - what the waiting thread raised
            errors.append(exc)

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    assert _wait(lambda: bool(core_client._waiting), 10)
    time.sleep(0.3)
    t = time.monotonic()
    assert core_client.cancel_startup() >= 1
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - t < 1.0
    assert isinstance(errors[0], core_client.StartupCancelled) and address in str(errors[0])
    assert not core_client._waiting

    # Python's own SIGINT handler: a process started in the background by a non-interactive shell
    # (CI) inherits SIGINT ignored, and then Python installs none.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    t = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            AsyncCoreClient(address=address, connect_timeout=20)
    finally:
        timer.join()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - t < 3.0


async def test_a_restarted_shared_core_gets_the_adapters_this_client_loaded(
    model: str, core: _Core, address: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A shared core replaced (a new core_id in its Ready) has none of the adapters: the client
    loads again those it loaded (not those it unloaded), 503 meanwhile, then serves them."""
    ad = make_peft_adapter(model, tmp_path / "ad", seed=1, r=8)
    c = await _client(address)
    c.dead_timeout = 2.0  # DEAD_S is 30: Hello again after 2 s of silence
    try:
        await c.load_adapter("ad", ad)
        await c.load_adapter("gone", ad)
        await c.unload_adapter("gone")
        sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        before = (await _collect(c, "hi", sp, adapter="ad"))[-1].outputs[0].token_ids
        core.stop()
        with caplog.at_level(logging.WARNING, "lorastar"):
            again = await asyncio.to_thread(_Core, _config(model), address)
            try:
                ready = lambda: c._core_id == again.proc.core_id and not c.restarting  # noqa: E731
                assert await asyncio.to_thread(_wait, ready, 30)
                assert [a.name for a in again.proc.engine.list_adapters()] == ["ad"]
                assert await asyncio.to_thread(
                    _wait, lambda: [a.name for a in c.list_adapters()] == ["ad"], 10
                )
                after = (await _collect(c, "hi", sp, adapter="ad"))[-1].outputs[0].token_ids
                assert after == before
                assert f"engine core at {address} restarted; reloading 1 adapters" in caplog.text
            finally:
                await c.shutdown(drain_timeout=0)
                again.stop()
    finally:
        await c.shutdown(drain_timeout=0)
