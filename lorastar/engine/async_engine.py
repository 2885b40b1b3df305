"""AsyncLLM: the engine's step loop on a background thread, streamed to asyncio callers.

The loop thread owns stepping; callers on any event loop get cumulative ``RequestOutput``s
through an ``asyncio.Queue``. Aborts (explicit, or a consumer that goes away) are queued and
applied between steps, so a disconnected client's blocks are freed at the next step boundary.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from lorastar.adapters.registry import AdapterInfo
from lorastar.config import EngineConfig
from lorastar.engine.engine import LLMEngine
from lorastar.engine.errors import EngineDeadError
from lorastar.engine.metrics import EngineStats
from lorastar.engine.outputs import RequestOutput
from lorastar.engine.sampling import SamplingParams

logger = logging.getLogger("lorastar")

_Stream = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        config = config if config is not None else EngineConfig.from_kwargs(**kwargs)
        self.engine = LLMEngine(config)
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._aborts: deque[str] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ---- properties -------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def errored(self) -> bool:
        return self._error is not None

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
        while self.is_running and self.engine.has_unfinished() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        with self.engine.lock:
            for rid in list(self.engine.requests):
                out = self.engine.abort_request(rid)
                if out is not None:
                    self._dispatch(out)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
        self._thread = None

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            try:
                while self._aborts:
                    out = eng.abort_request(self._aborts.popleft())
                    if out is not None:
                        self._dispatch(out)
                if not eng.has_unfinished():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                for out in eng.step():
                    self._dispatch(out)
            except BaseException as e:  # the engine is broken: fail every stream, refuse new work
                logger.exception("engine step loop died")
                self._error = e
                with self._streams_lock:
                    streams = list(self._streams.values())
                    self._streams.clear()
                for loop, q in streams:
                    loop.call_soon_threadsafe(q.put_nowait, EngineDeadError(f"engine died: {e!r}"))
                return

    def _dispatch(self, out: RequestOutput) -> None:
        with self._streams_lock:
            stream = self._streams.get(out.request_id)
            if stream is not None and out.finished:
                del self._streams[out.request_id]
        if stream is not None:
            loop, q = stream
            try:
                loop.call_soon_threadsafe(q.put_nowait, out)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                pass

    # ---- requests ------------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        *,
        adapter: str | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs; the last has ``finished=True``. Closing the iterator early
        (or cancelling its task) aborts the request."""
        if self._error is not None:
            raise EngineDeadError(f"engine died: {self._error!r}")
        await self.start()
        rid = request_id or uuid.uuid4().hex
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._streams_lock:
            if rid in self._streams:
                raise ValueError(f"request_id {rid!r} is already in use")
            self._streams[rid] = (asyncio.get_running_loop(), q)
        add = asyncio.ensure_future(
            asyncio.to_thread(
                self.engine.add_request, prompt, sampling_params, adapter=adapter, request_id=rid
            )
        )
        try:
            # Shielded: if we are cancelled mid-add, the add still completes and is aborted below,
            # instead of running unobserved to max_tokens.
            await asyncio.shield(add)
        except asyncio.CancelledError:
            with self._streams_lock:
                self._streams.pop(rid, None)
            add.add_done_callback(
                lambda f: f.cancelled() or f.exception() is not None or self._queue_abort(rid)
            )
            raise
        except BaseException:
            with self._streams_lock:
                self._streams.pop(rid, None)
            raise
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await q.get()
                while not q.empty():  # outputs are cumulative: skip to the newest
                    nxt = q.get_nowait()
                    if isinstance(item, RequestOutput) and isinstance(nxt, RequestOutput):
                        item = nxt
                    else:
                        item = nxt if isinstance(nxt, BaseException) else item
                        break
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                with self._streams_lock:
                    self._streams.pop(rid, None)
                self._queue_abort(rid)

    def fail_streams(self, exc: BaseException) -> int:
        """End every open stream by raising ``exc`` in it (its request aborted); how many there were."""
        with self._streams_lock:
            streams = list(self._streams.items())
            self._streams.clear()
        for rid, (loop, q) in streams:
            self._queue_abort(rid)
            loop.call_soon_threadsafe(q.put_nowait, exc)
        return len(streams)

    def _queue_abort(self, request_id: str) -> None:
        self._aborts.append(request_id)
        self._wake.set()

    async def abort(self, request_id: str) -> None:
        self._queue_abort(request_id)

    # ---- adapters ------------------------------------------------------------------------------
    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        # Reading + validating runs off the event loop and outside the step lock.
        return await asyncio.to_thread(self.engine.load_adapter, name, path)

    async def unload_adapter(self, name: str) -> None:
        await asyncio.to_thread(self.engine.unload_adapter, name)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.engine.list_adapters()

    # ---- misc ------------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of ``prompt`` as ``generate`` would see them (special tokens added)."""
        return self.engine.tokenize(prompt)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.engine.apply_chat_template(messages, add_generation_prompt)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def kv_cache_usage(self) -> dict[str, float | int]:
        return self.engine.kv_cache_usage().as_dict()
