"""AsyncLLM: the engine's step loop on a background thread, streamed to asyncio callers.

The loop thread owns stepping; callers on any event loop get cumulative ``RequestOutput``s
through an ``asyncio.Queue``. Aborts (explicit, or a consumer that goes away) are queued and
applied between steps, so a disconnected client's blocks are freed at the next step boundary.

A step that raises does not end the service: the requests that had started get a
``RequestFailedError`` (one of them may be the cause, so none is retried), the engine is rebuilt
from its config (weights reloaded, adapters re-registered from the registry's record of names and
paths) with a capped exponential backoff, and requests still queued move to the new engine
unchanged. While it rebuilds, new work gets ``EngineUnavailableError`` (HTTP 503 + Retry-After).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from lorastar.adapters.info import AdapterInfo
from lorastar.config import EngineConfig
from lorastar.engine.engine import LLMEngine
from lorastar.engine.input_processor import InputProcessor, PromptInputs
from lorastar.engine.metrics import EngineStats
from lorastar.engine.outputs import RequestOutput
from lorastar.engine.sampling import RequestOutputKind, SamplingParams
from lorastar.engine.streams import Embeds, Stream, deliver, release_id, stream_outputs
from lorastar.engine.summary import engine_info
from lorastar.engine.threads import run_in_fresh_thread, to_fresh_thread
from lorastar.errors import (
    EngineDeadError,
    EngineUnavailableError,
    RequestFailedError,
)

logger = logging.getLogger("lorastar")


class AsyncLLM(PromptInputs, Embeds):
    # Rebuild backoff: first wait, cap (seconds); the wait doubles per failed rebuild and resets
    # after a step succeeds. Rebuilds are retried until one works or shutdown() is called.
    restart_backoff: tuple[float, float] = (0.5, 30.0)

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        config = EngineConfig.given(config, **kwargs)
        self.config = config
        # Built on a thread that exits: no OpenMP pool outlives it next to the step thread's
        # (engine/threads.py).
        self.engine = run_in_fresh_thread(LLMEngine, config, thread_name="lorastar-engine-build")
        # Read by the HTTP layer while a rebuild swaps the engine: fixed for the model.
        self._tokenizer = self.engine.tokenizer
        self._model_name = self.engine.model_name
        self._max_model_len = self.engine.max_model_len
        self._vocab_size = self.engine.vocab_size
        # Held while a request is added and while the engine is swapped: an add never lands
        # in an engine that is being thrown away.
        self._swap_lock = threading.Lock()
        self._restarting = False
        self._retry_after = self.restart_backoff[0]
        self.num_restarts = 0
        # Streams, aborts and the engine are keyed by wire id: the caller's request id plus a
        # number of our own, so a late output or queued abort of an earlier request under the
        # same id (its stream closed or finished) cannot reach a new one (vLLM's internal ids).
        # ``_open``: the caller's id -> the wire id of its open stream.
        self._streams: dict[str, Stream] = {}
        self._open: dict[str, str] = {}
        self._wire_ids = itertools.count()
        self._streams_lock = threading.Lock()
        self._aborts: deque[str] = deque()
        # Ids whose add is in flight (``_add_request`` on a worker thread), and those of them an
        # abort named meanwhile: the loop applied that abort before the request existed, so it is
        # queued again once the add lands (under ``_streams_lock``).
        self._adding: set[str] = set()
        self._aborted_adding: set[str] = set()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ---- properties -------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def default_sampling(self) -> dict[str, Any]:
        """``generation_config.json``'s sampling defaults (``EngineConfig.generation_config``)."""
        return self.engine.default_sampling

    @property
    def max_logprobs(self) -> int:
        """Most top logprobs a request may ask for (``EngineConfig.max_logprobs``, resolved)."""
        return self.engine.max_logprobs

    @property
    def max_waiting(self) -> int | None:
        """Most requests queued and not yet started (``EngineConfig.max_waiting``; None: no bound)."""
        return self.config.max_waiting

    @property
    def errored(self) -> bool:
        """The loop ended for good (it only does on a non-``Exception`` error)."""
        return self._error is not None

    @property
    def restarting(self) -> bool:
        """A step failed and the engine is being rebuilt; new work is refused meanwhile."""
        return self._restarting

    @property
    def retry_after(self) -> float:
        """Seconds a client should wait before retrying while ``restarting``."""
        return self._retry_after

    def _check_available(self) -> None:
        if self._error is not None:
            raise EngineDeadError("The engine has stopped and cannot serve requests.")
        if self._restarting:
            raise EngineUnavailableError(
                "The engine is restarting after a failure; retry shortly.", self._retry_after
            )

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="lorastar-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, drain_timeout: float = 5.0) -> None:
        """Let in-flight requests finish for up to ``drain_timeout`` s, abort the rest, stop."""
        deadline = time.monotonic() + drain_timeout
        while (
            self.is_running
            and (self.engine.has_unfinished() or self._adding)  # (an add in flight: a grammar compiling)
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.02)

        def refuse_adds() -> None:  # an add still in flight now is refused, not left with no loop
            with self._swap_lock:
                self._stop.set()

        await asyncio.to_thread(refuse_adds)
        with self.engine.lock:
            for rid in list(self.engine.requests):
                out = self.engine.abort_request(rid)
                if out is not None:
                    self._dispatch(out)
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
        self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            eng = self.engine
            try:
                while self._aborts:
                    out = eng.abort_request(self._aborts.popleft())
                    if out is not None:
                        self._dispatch(out)
                if not eng.has_unfinished():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._dispatch_many(eng.step())
                self._retry_after = self.restart_backoff[0]
            except Exception as e:
                logger.exception("lorastar: engine step failed; rebuilding the engine")
                self._recover(e)
            except BaseException as e:  # KeyboardInterrupt, SystemExit: stop for good
                logger.exception("lorastar: engine step loop stopped")
                self._error = e
                self.fail_streams(EngineDeadError("The engine has stopped."))
                return

    def _recover(self, cause: Exception) -> None:
        """Fail the started requests, rebuild the engine, move queued requests to it."""
        old = self.engine
        with self._swap_lock:
            self._restarting = True

        def waiting(delay: float) -> None:
            self._retry_after = delay

        new = rebuild_engine(
            old, self.config, fail=self._fail, stop=self._stop, delay=self._retry_after,
            cap=self.restart_backoff[1], lock=self._swap_lock, on_wait=waiting,
        )  # fmt: skip
        del old
        if new is None:
            self.fail_streams(EngineDeadError("The engine was shut down while restarting."))
            return
        with self._swap_lock:
            self.engine = new
            self.num_restarts += 1
            self._restarting = False
        logger.warning("lorastar: engine rebuilt after a failed step (%s)", type(cause).__name__)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        with self._streams_lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._put(stream, exc)

    @staticmethod
    def _put(stream: Stream, item: RequestOutput | BaseException) -> None:
        loop, q = stream
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass

    def _dispatch_many(self, outs: list[RequestOutput]) -> None:
        if len(outs) <= 1:
            for out in outs:
                self._dispatch(out)
            return
        deliver(self._streams, self._streams_lock, outs)

    def _dispatch(self, out: RequestOutput) -> None:
        with self._streams_lock:
            stream = self._streams.get(out.request_id)
            if stream is not None and out.finished:
                del self._streams[out.request_id]
        if stream is not None:
            self._put(stream, out)

    # ---- requests ------------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int] | Mapping[str, Any],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        adapter: str | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs, of ``sampling_params.output_kind`` (cumulative by default;
        DELTA: each holds what is new, FINAL_ONLY: one at the end); the last has ``finished=True``.
        Closing the iterator early (or cancelling its task) aborts the request. ``priority``: lower
        first under ``EngineConfig.scheduling_policy="priority"`` (0 otherwise)."""
        if isinstance(sampling_params, Mapping):  # as the engine takes it; its output_kind is read below
            sampling_params = SamplingParams.from_dict(sampling_params)
        self._check_available()
        await self.start()
        rid = request_id or uuid.uuid4().hex
        wire = f"{rid}-{next(self._wire_ids)}"
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._streams_lock:
            if self._open.get(rid) in self._streams:
                raise ValueError(f"request_id {rid!r} is already in use")
            self._streams[wire] = (asyncio.get_running_loop(), q)
            self._open[rid] = wire
            self._adding.add(wire)
        try:
            add = asyncio.ensure_future(
                asyncio.to_thread(self._add_request, prompt, sampling_params, adapter, wire, priority)
            )
            try:
                # Shielded: if we are cancelled mid-add, the add still completes and is aborted
                # below, instead of running unobserved to max_tokens.
                await asyncio.shield(add)
            except asyncio.CancelledError:
                with self._streams_lock:
                    self._streams.pop(wire, None)
                add.add_done_callback(
                    lambda f: f.cancelled() or f.exception() is not None or self._queue_abort(wire)
                )
                raise
            except BaseException:
                with self._streams_lock:
                    self._streams.pop(wire, None)
                raise
            self._wake.set()
            delta = sampling_params is not None and sampling_params.output_kind == RequestOutputKind.DELTA

            def abandon() -> None:
                with self._streams_lock:
                    self._streams.pop(wire, None)
                self._queue_abort(wire)

            async with contextlib.aclosing(stream_outputs(q, delta, abandon, rid)) as outputs:
                async for out in outputs:
                    yield out
        finally:
            release_id(self._open, self._streams_lock, rid, wire)

    def _add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        adapter: str | None,
        rid: str,
        priority: int = 0,
    ) -> None:
        try:
            grammar = None
            if isinstance(params, SamplingParams) and params.grammar_spec is not None:
                # Compiling can take seconds: outside the lock, so other requests' adds do not queue
                # behind it (xgrammar releases the GIL: the step loop runs on meanwhile).
                grammar = self.engine.compile_grammar(params)
            with self._swap_lock:
                self._check_available()
                if self._stop.is_set():  # shutdown() ran meanwhile (start() clears it)
                    raise EngineDeadError("The engine was shut down.")
                self.engine.add_request(
                    prompt, params, adapter=adapter, request_id=rid, grammar=grammar, priority=priority
                )
        finally:
            with self._streams_lock:
                self._adding.discard(rid)
                aborted = rid in self._aborted_adding
                self._aborted_adding.discard(rid)
        if aborted:  # aborted while being added: the abort the loop applied found nothing
            self._queue_abort(rid)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def fail_streams(self, exc: BaseException) -> int:
        """End every open stream by raising ``exc`` in it (its request aborted); how many there were."""
        with self._streams_lock:
            streams = list(self._streams.items())
            self._streams.clear()
        for rid, stream in streams:
            self._queue_abort(rid)
            self._put(stream, exc)
        return len(streams)

    def _queue_abort(self, request_id: str) -> None:
        self._aborts.append(request_id)
        self._wake.set()

    async def abort(self, request_id: str) -> None:
        with self._streams_lock:
            wire = self._open.get(request_id)
            if wire is None:  # not open here (finished, closed, never added): nothing to abort
                return
            if wire in self._adding:
                self._aborted_adding.add(wire)
        self._queue_abort(wire)

    # ---- adapters ------------------------------------------------------------------------------
    async def load_adapter(self, name: str, path: str, *, new: bool = False) -> AdapterInfo:
        # Reading + validating runs off the event loop and outside the step lock.
        self._check_available()
        while True:
            engine = self.engine
            info = await to_fresh_thread(
                functools.partial(engine.load_adapter, new=new),
                name,
                path,
                thread_name="lorastar-adapter-load",
            )
            # A step that failed meanwhile rebuilt the engine from the adapters the old one held
            # before this load registered there: its success must mean the new one serves it.
            while self._restarting and not self._stop.is_set():
                await asyncio.sleep(0.05)
            if self.engine is engine or name in self.engine.registry or self._stop.is_set():
                return info
            new = False  # (the name was free when this load began)

    async def unload_adapter(self, name: str) -> None:
        self._check_available()
        await to_fresh_thread(self.engine.unload_adapter, name, thread_name="lorastar-adapter-unload")

    def list_adapters(self) -> list[AdapterInfo]:
        return self.engine.list_adapters()

    async def reset_prefix_cache(self) -> bool:
        """``LLMEngine.reset_prefix_cache`` (it waits for the step lock: off the event loop)."""
        self._check_available()
        return await asyncio.to_thread(self.engine.reset_prefix_cache)

    def has_adapter(self, name: str) -> bool:
        """Whether adapter ``name`` is registered (``name in list_adapters()`` without the listing)."""
        return name in self.engine.registry

    # ---- misc ------------------------------------------------------------------------------------
    @property
    def info(self) -> dict[str, Any]:
        """dtype, device, max_model_len, block_size (``summary.engine_info``; the operator page)."""
        return engine_info(self.engine)

    @property
    def inputs(self) -> InputProcessor:
        """The engine's prompt checks and tokenizer (``PromptInputs``' methods go through it)."""
        return self.engine.inputs

    def stats(self) -> EngineStats | None:
        """The engine's counters; ``None`` while it is being rebuilt (its gauges are gone)."""
        if self._restarting:
            return None
        return self.engine.stats()

    def kv_cache_usage(self) -> dict[str, float | int]:
        return self.engine.kv_cache_usage().as_dict()


def rebuild_engine(
    old: LLMEngine,
    config: EngineConfig,
    *,
    fail: Callable[[str, BaseException], None],
    stop: threading.Event,
    delay: float,
    cap: float,
    lock: AbstractContextManager[Any] | None = None,
    on_wait: Callable[[float], None] | None = None,
    core_only: bool = False,
) -> LLMEngine | None:
    """After a failed step: fail the requests that had started (one of them may be the cause, so
    none is retried), close ``old``, build a new engine from ``config`` (retried with a doubling
    wait from ``delay`` up to ``cap`` until it works or ``stop`` is set: then ``None``), re-register
    the adapters by name and path, and move the never-scheduled requests to it unchanged.
    ``lock`` is held while requests are read from ``old`` and moved to the new engine.
    ``core_only``: the engine runs a core process (its outputs are detokenized by the frontend)."""
    lock = lock if lock is not None else contextlib.nullcontext()
    with lock, old.lock:
        started, queued = [], []
        for r in old.requests.values():
            (started if r.first_scheduled_time is not None or r.forked else queued).append(r)
        adapters = [(a.name, a.path) for a in old.list_adapters()]
    tokenizer = old.tokenizer_loader  # same config, same folder
    failure = RequestFailedError(
        "The engine failed while running this request and is restarting; retry the request."
    )
    for req in started:
        fail(req.request_id, failure)
    old.close()
    del old
    gc.collect()
    while not stop.is_set():
        try:
            # a core's engine: its (lazily) loaded tokenizer again (EngineCoreProc)
            new = (
                LLMEngine(config, lazy_tokenizer=True, tokenizer=tokenizer)
                if core_only
                else LLMEngine(config)
            )
            for name, path in adapters:
                try:
                    new.load_adapter(name, path)
                except Exception:  # the folder changed or vanished since it was loaded
                    logger.exception("lorastar: adapter %r (%s) not re-registered", name, path)
            break
        except Exception:
            logger.exception("lorastar: engine rebuild failed; retrying in %.1f s", delay)
            if on_wait is not None:
                on_wait(delay)
            stop.wait(delay)
            delay = min(2 * delay, cap)
    else:
        return None
    with lock:
        for req in queued:  # never scheduled: the same request, unchanged, on the new engine
            try:
                add = new.add_core_request if core_only else new.add_request
                add(req.prompt_token_ids, req.params, adapter=req.adapter_name, request_id=req.request_id)
            except Exception as exc:
                fail(req.request_id, exc)
    return new
