"""AsyncCoreClient: the ``AsyncLLM`` interface with the engine core in another process.

This process keeps what is per request and cheap: tokenizing and validating prompts (once, here),
the asyncio streams, and the HTTP layer that calls it. The core process (engine/core_proc.py)
steps the engine and sends each step's outputs; a receiver thread decodes them and hands them to
their streams with one wake-up per event loop per step.

Two ways to get a core:
- spawned (``address=None``): a child process of this one (``python -m lorastar.engine.core_proc``),
  talking over ipc sockets in a private temporary folder. If it dies (killed, out of memory), open
  requests fail with ``RequestFailedError``, a new one is started with a doubling back-off, the
  adapters it held are loaded again, and meanwhile new work gets ``EngineUnavailableError`` (503).
- shared (``address="tcp://host:port"`` or ``"ipc:///path"``): a core started by ``lorastar engine``
  that several app workers connect to (one copy of the model for all of them). The core must run on
  the same host (clients bind their output socket on 127.0.0.1 or a local ipc path). Starting, the
  client waits ``connect_timeout`` s for something to accept its connection (none: no core there),
  then up to ``start_timeout`` s for the core's ``Ready`` (it answers once its model is loaded),
  logging while it waits; ``cancel_startup()`` (for a signal handler) or ``shutdown`` ends the wait.
  A core that answers with a new ``core_id`` was restarted: open requests fail, and the adapters it
  held are loaded again (``restarting`` meanwhile), also those loaded through a client since gone.
  A core silent for ``STALE_S`` counts as restarting (503) until it speaks again; silent for
  ``dead_timeout`` (``DEAD_S``) it is taken for dead, as vLLM's ``EngineDeadError``: open requests and adapter calls
  fail with ``RequestFailedError`` (as when a spawned core exits). The client keeps saying ``Hello``,
  so a core that comes back serves new requests (and is told to abort the ones failed here).

Sends never block (they run on the event loop): the input socket queues without bound, as vLLM's
do (``SNDHWM`` 0; zmq's default of 1000 made a burst of requests during one long step block the
loop, or with a dead core freeze it), and a fresh socket replaces it once a core is taken for dead
(what it queued is dropped). Should a send still find no room, the message is dropped, or its
caller fails (503) for a request or an adapter call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from lorastar.adapters.info import AdapterInfo
from lorastar.config import EngineConfig
from lorastar.engine.input_processor import InputProcessor, PromptInputs, load_tokenizer
from lorastar.engine.messages import (
    Abort,
    AddRequest,
    Call,
    CoreOutput,
    FinishSamples,
    Goodbye,
    Hello,
    Outputs,
    Ready,
    Reply,
    StartupFailed,
    State,
    encoder,
    output_decoder,
    to_error,
)
from lorastar.engine.metrics import EngineStats
from lorastar.engine.output_processor import OutputProcessor
from lorastar.engine.outputs import RequestOutput
from lorastar.engine.request import check_priority_value
from lorastar.engine.sampling import RequestOutputKind, SamplingParams
from lorastar.engine.streams import Embeds, Stream, deliver, release_id, stream_outputs
from lorastar.errors import (
    EngineDeadError,
    EngineUnavailableError,
    InvalidParamError,
    RequestFailedError,
    StartupCancelled,
)

logger = logging.getLogger("lorastar")

STALE_S = 5.0  # a shared core silent this long counts as restarting
# ... and this long as dead: its open requests and calls fail. Well past STALE_S: a busy core sends
# State at least every STATE_EVERY_S (0.1 s), an idle one every HEARTBEAT_S (1 s); only a core that
# is gone, stopped or rebuilding its engine (a model load) is silent for long.
DEAD_S = 30.0
RESPAWN_BACKOFF = (0.5, 30.0)
CONNECT_S = 60.0  # nothing at a shared core's address accepting a connection this long: no core there
WAIT_LOG_S = 10.0  # a client waiting for its shared core says so this often

# The stop events of constructors waiting for their core (cancel_startup sets them).
_waiting: set[threading.Event] = set()
_waiting_lock = threading.Lock()


def cancel_startup() -> int:
    """End the wait of every ``AsyncCoreClient`` constructor waiting for its core (they raise
    ``StartupCancelled`` within ~0.1 s): for a signal handler while an app's startup waits on a
    thread, where the signal cannot reach it. Returns how many were waiting."""
    with _waiting_lock:
        events = list(_waiting)
    for ev in events:
        ev.set()
    return len(events)


class AsyncCoreClient(PromptInputs, Embeds):
    """``EngineClient`` over an engine core process (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        address: str | None = None,
        start_timeout: float = 900.0,
        connect_timeout: float = CONNECT_S,
        dead_timeout: float = DEAD_S,
        **kwargs: Any,
    ) -> None:
        self.config = EngineConfig.given(config, **kwargs)
        self.start_timeout = start_timeout  # for Ready (a core loads its model first)
        self.connect_timeout = connect_timeout  # a shared core: for its address to accept a connection
        self.dead_timeout = dead_timeout  # a shared core silent this long is taken for dead
        self._owns_core = address is None
        self._tmp = tempfile.mkdtemp(prefix="lorastar-core-")
        self._input_address = address or f"ipc://{self._tmp}/input"
        self._client_id = uuid.uuid4().hex
        self._ctx = zmq.Context()
        try:
            self._out = self._ctx.socket(zmq.PULL)
            if self._input_address.startswith("ipc://"):
                self._output_address = f"ipc://{self._tmp}/output"
                self._out.bind(self._output_address)
            else:
                port = self._out.bind_to_random_port("tcp://127.0.0.1")
                self._output_address = f"tcp://127.0.0.1:{port}"
            self._stop = threading.Event()  # ends a wait for the core (cancel_startup, shutdown)
            # A shared core's address: its connections are watched while this waits for Ready.
            self._monitor: zmq.Socket | None = None if self._owns_core else self._ctx.socket(zmq.PAIR)
            self._in = self._new_input()
        except BaseException:  # an address zmq refuses: leave no context or temporary folder behind
            self._ctx.destroy(linger=0)
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise
        self._send_lock = threading.Lock()  # guards self._in (zmq sockets are not thread-safe)
        self._enc = encoder()
        self._dec = output_decoder()
        # Streams and the output processor are keyed by wire id: the caller's request id plus a
        # number of this client's own, so a late output or abort of an earlier request under the
        # same id (closed or finished here, not yet in the core) cannot reach the new one (vLLM's
        # internal request ids). ``_open``: the caller's id -> the wire id of its open stream.
        self._streams: dict[str, Stream] = {}
        self._open: dict[str, str] = {}
        self._wire_ids = itertools.count()
        self._streams_lock = threading.Lock()
        self._outputs_lock = threading.Lock()  # the output processor: receiver thread vs callers
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._proc: subprocess.Popen[bytes] | None = None
        self._closing = False
        self._stopping_core = False  # shutdown() asked the spawned core to exit
        self._respawning = False
        self._reloading = 0  # adapters being loaded again into a new core (restarting meanwhile)
        self._reload_lock = threading.Lock()
        # name -> path of the adapters the core held, as last heard (loaded through any client: a
        # shared core that restarts gets them again from the workers that remain)
        self._adapters: dict[str, str] = {}
        # The core's adapter listing as last sent (a State sends it only when it changed), the names
        # in it, and whether _adapters was taken from it since.
        self._rows: list[AdapterInfo] = []
        self._row_names: frozenset[str] = frozenset()
        self._rows_synced = True
        self._retry_after = RESPAWN_BACKOFF[0]
        self._respawns = 0
        self._core_id = ""
        self._state: State | None = None
        self._last_heard = time.monotonic()
        # Requests aborted or failed here while a shared core was silent: aborted in it once it speaks.
        self._orphans: set[str] = set()
        self._orphans_lock = threading.Lock()
        with _waiting_lock:
            _waiting.add(self._stop)
        try:
            if self._owns_core:
                self._spawn()
            # transformers' import (~1 s) while the core loads, not after its Ready
            importer = threading.Thread(target=_import_tokenizer_modules, name="lorastar-import", daemon=True)
            importer.start()
            ready = self._hello_and_wait()
            self._stop_monitor()
            # Not beside that import: transformers' lazy module breaks under two first imports at once
            # (a core already ready answers at once).
            importer.join()
            # The core loads its own lazily (TokenizerLoader): a folder it cannot load fails here.
            self._tokenizer = load_tokenizer(Path(ready.tokenizer_dir), ready.chat_template)
        except BaseException:
            self._close_sockets()
            raise
        finally:
            with _waiting_lock:
                _waiting.discard(self._stop)
        self.model_name = ready.model_name
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.max_waiting = ready.max_waiting
        self.max_logprobs = ready.max_logprobs
        self.summary = ready.summary
        self.info = ready.info  # dtype, device, max_model_len, block_size (the operator page's header)
        self.default_sampling = ready.default_sampling  # generation_config.json's, for the routes
        # Text, stop strings and RequestOutputs from the core's deltas, in this process.
        self._processor = OutputProcessor(self._tokenizer)
        self.inputs = InputProcessor(
            self._tokenizer, model_name=ready.model_name, max_model_len=ready.max_model_len,
            max_prompt_bytes=ready.max_prompt_bytes, vocab_size=ready.vocab_size,
        )  # fmt: skip
        self._thread = threading.Thread(target=self._receive_loop, name="lorastar-core-client", daemon=True)
        self._thread.start()

    # ---- the core process --------------------------------------------------------------------
    def _spawn(self) -> None:
        cfg_path = Path(self._tmp) / "config.pickle"
        cfg_path.write_bytes(pickle.dumps(self.config))
        cmd = [sys.executable, "-m", "lorastar.engine.core_proc", "--config-file", str(cfg_path),
               "--address", self._input_address, "--report-to", self._output_address]  # fmt: skip
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)

    def _hello_and_wait(self) -> Ready:
        """Announce this client and wait for the core's ``Ready`` (the core may still be loading).

        Short polls, so ``self._stop`` (and on the main thread a signal) ends the wait at once. A
        shared core (``self._monitor``): nothing accepting a connection for ``connect_timeout`` s
        means no core at the address; one that accepts and has not answered is still loading."""
        addr = self._input_address
        self._send(Hello(self._client_id, self._output_address))
        start = time.monotonic()
        deadline = start + self.start_timeout
        connect_by = start + self.connect_timeout
        connected = ever_connected = False
        next_log = start + WAIT_LOG_S
        while not self._stop.is_set():
            if self._out.poll(100):
                msg = self._dec.decode(self._out.recv())
                if isinstance(msg, StartupFailed):
                    raise to_error(msg.error)
                if isinstance(msg, Ready):
                    self._on_ready(msg)
                    return msg
                continue  # a late message of a core that died
            if self._proc is not None and (code := self._proc.poll()) is not None:
                raise RuntimeError(f"the engine core process exited with code {code} while starting")
            now = time.monotonic()
            if self._monitor is not None:
                while self._monitor.poll(0):
                    event = recv_monitor_message(self._monitor)["event"]
                    if event == zmq.EVENT_CONNECTED:
                        if ever_connected:  # a core that went away took our Hello with it
                            self._send(Hello(self._client_id, self._output_address))
                        connected = ever_connected = True
                    elif event == zmq.EVENT_DISCONNECTED:
                        connected = False
                        connect_by = now + self.connect_timeout
                if not connected and now >= connect_by:
                    raise ConnectionError(
                        f"no engine core at {addr}: nothing accepted a connection in "
                        f"{self.connect_timeout:.0f} s (start one with `lorastar engine --address {addr}`)"
                    )
                if now >= next_log:
                    next_log = now + WAIT_LOG_S
                    logger.warning(
                        "lorastar: waiting for the engine core at %s (%s, %.0f s)", addr,
                        "connected; loading its model?" if connected else "not accepting connections",
                        now - start,
                    )  # fmt: skip
            if now >= deadline:
                raise TimeoutError(f"the engine core at {addr} was not ready in {self.start_timeout:.0f} s")
        raise StartupCancelled(f"stopped while waiting for the engine core at {addr}")

    def _stop_monitor(self) -> None:
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._in.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None

    def _on_ready(self, ready: Ready) -> None:
        restarted = bool(self._core_id) and ready.core_id != self._core_id
        if restarted:
            self._fail_all(RequestFailedError("The engine core restarted; retry the request."))
        elif self._core_id and not ready.known_client:  # it dropped us and aborted our requests
            self._fail_all(RequestFailedError("The engine core dropped this client; retry the request."))
        self._core_id = ready.core_id
        if restarted and not self._owns_core:  # (a spawned one: _core_died loads them again)
            adapters = list(self._adapters.items())
            logger.warning(
                "lorastar: engine core at %s restarted; reloading %d adapters", self._input_address, len(adapters)
            )  # fmt: skip
            self._reload_adapters(adapters)  # (restarting from before the state below says it is not)
        self._set_state(ready.state)
        self._last_heard = time.monotonic()

    def _reload_adapters(self, adapters: list[tuple[str, str]]) -> None:
        """Load ``adapters`` into a new core; ``restarting`` (503) until each is answered."""
        if not adapters:
            return
        with self._reload_lock:
            self._reloading += len(adapters)

        def reloaded(f: concurrent.futures.Future[Any]) -> None:
            if f.exception() is not None:
                logger.error("lorastar: adapter not re-registered after restart: %s", f.exception())
            with self._reload_lock:
                self._reloading -= 1

        for name, path in adapters:
            self._start_call("load_adapter", [name, path]).add_done_callback(reloaded)

    def _core_died(self, code: int) -> None:
        """The spawned core exited: fail what was open, start a new one, load its adapters again."""
        logger.error("lorastar: the engine core process exited with code %s; starting a new one", code)
        self._respawning = True
        # Not the last listing: empty while its engine rebuilt, partial while it was given them back
        adapters = list(self._adapters.items())
        self._fail_all(
            RequestFailedError(f"The engine core process exited (code {code}); retry the request.")
        )
        delay = RESPAWN_BACKOFF[0]
        while not self._closing and not self._stop.is_set():
            try:
                self._reconnect_input()  # the Hello must not queue behind what the dead core left
                self._spawn()
                self._hello_and_wait()
                break
            except Exception:
                if self._stop.is_set():  # shutdown() ended the wait
                    break
                logger.exception("lorastar: engine core restart failed; retrying in %.1f s", delay)
                if self._proc is not None and self._proc.poll() is None:
                    self._proc.kill()
                self._retry_after = delay
                self._stop.wait(delay)
                delay = min(2 * delay, RESPAWN_BACKOFF[1])
        if self._closing or self._stop.is_set():
            return
        self._respawns += 1
        self._reload_adapters(adapters)  # restarting (503) until they are loaded
        self._respawning = False

    # ---- the receiver thread -------------------------------------------------------------------
    def _receive_loop(self) -> None:
        last_hello = 0.0
        while not self._closing:
            try:
                if self._out.poll(100):
                    self._receive_all()
                now = time.monotonic()
                if self._proc is not None and (code := self._proc.poll()) is not None:
                    if self._stopping_core:  # asked to exit: hand out what it sent last, and stop
                        self._receive_all()
                        return
                    self._core_died(code)
                elif not self._owns_core:
                    silent = now - self._last_heard
                    if silent > self.dead_timeout:
                        self._fail_silent(silent)
                    if silent > self._stale_after and now - last_hello > 1.0:
                        last_hello = now  # a shared core that restarts forgets us: say hello again
                        if silent > self.dead_timeout:  # one Hello queued at a time, nothing else
                            self._reconnect_input()
                        self._send(Hello(self._client_id, self._output_address))
            except zmq.ContextTerminated:
                return
            except Exception:  # a bug here must not silently stop every stream
                logger.exception("lorastar: engine client receiver error")

    def _receive_all(self) -> None:
        while True:
            try:
                data = self._out.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(self._dec.decode(data.buffer))

    def _handle(self, msg: CoreOutput) -> None:
        self._last_heard = time.monotonic()
        if self._orphans:  # it speaks again: abort there what ended here while it was silent
            with self._orphans_lock:
                rids, self._orphans = list(self._orphans), set()
            self._send(Abort(rids, self._client_id))
        if isinstance(msg, Outputs):
            if msg.state is not None and msg.state.core_id == self._core_id:
                self._set_state(msg.state)
            with self._outputs_lock:
                outs, stops = self._processor.process(msg.outputs)
            if stops:  # ended here on a stop string: the core stops computing them
                self._send(FinishSamples(stops, self._client_id))
            if outs:
                deliver(self._streams, self._streams_lock, outs)
            for rid, info in msg.failures:
                self._fail(rid, to_error(info))
        elif isinstance(msg, State):
            if msg.core_id != self._core_id:
                return  # a late message of a core that died
            self._set_state(msg)
        elif isinstance(msg, Reply):
            fut = self._calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                if msg.error is not None:
                    fut.set_exception(to_error(msg.error))
                else:
                    fut.set_result(msg.result)
        elif isinstance(msg, Ready):
            self._on_ready(msg)

    def _set_state(self, state: State) -> None:
        if state.adapters is not None:
            self._rows, self._rows_synced = state.adapters, False
            self._row_names = frozenset(a.name for a in state.adapters)
        self._state = state
        # (a core rebuilding, respawned or reloading lists fewer)
        if not self._rows_synced and not state.restarting and not self._reloading and not self._respawning:
            self._adapters = {a.name: a.path for a in self._rows}
            self._rows_synced = True

    def _fail(self, request_id: str, exc: BaseException) -> None:
        with self._outputs_lock:
            self._processor.drop(request_id)
        with self._streams_lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            loop, q = stream
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                loop.call_soon_threadsafe(q.put_nowait, exc)

    def has_unfinished(self) -> bool:
        return bool(self._streams)

    def fail_streams(self, exc: BaseException) -> int:
        """End every open stream by raising ``exc`` in it (the core aborts them); how many there were."""
        with self._streams_lock:
            rids = list(self._streams)
        if rids:
            self._abort(rids)
        for rid in rids:
            self._fail(rid, exc)
        return len(rids)

    def _fail_silent(self, silent: float) -> None:
        """A shared core silent past ``dead_timeout``: fail what is open (called again while it
        stays silent, for what opened since), to be aborted there if it comes back."""
        with self._streams_lock:
            rids = list(self._streams)
        if not rids and not self._calls:
            return
        with self._orphans_lock:
            self._orphans.update(rids)
        self._fail_all(
            RequestFailedError(
                f"The engine core at {self._input_address} has not answered for {silent:.0f} s; "
                "retry the request."
            )
        )

    def _fail_all(self, exc: BaseException) -> None:
        with self._streams_lock:
            rids = list(self._streams)
        for rid in rids:
            self._fail(rid, exc)
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(exc)

    # ---- sending -------------------------------------------------------------------------------
    def _new_input(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # no bound: a send never waits for the core
        if self._monitor is not None:  # before connect: its first connection must not be missed
            endpoint = f"inproc://lorastar-monitor-{uuid.uuid4().hex}"
            sock.monitor(endpoint, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            self._monitor.connect(endpoint)
        sock.connect(self._input_address)
        return sock

    def _reconnect_input(self) -> None:
        """A fresh input socket: what the old one queued for a core that is not reading is dropped."""
        with self._send_lock:
            if self._closing:
                return
            self._in.close(linger=0)
            self._in = self._new_input()

    def _send(self, msg: Any) -> bool:
        return self._send_data(self._enc.encode(msg))

    def _send_data(self, data: bytes) -> bool:
        """Send without blocking (callers run on the event loop); False where the core's input pipe
        is full (the core is gone or stuck) and the message was dropped."""
        with self._send_lock:
            try:
                self._in.send(data, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                logger.debug("lorastar: engine core not reading its input; message dropped")
                return False
        return True

    def _not_reading(self) -> EngineUnavailableError:
        return EngineUnavailableError(
            "The engine core is not reading its input; retry shortly.", self.retry_after
        )

    def _start_call(self, method: str, args: list[str]) -> concurrent.futures.Future[Any]:
        call_id = next(self._call_ids)
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._calls[call_id] = fut
        if not self._send(Call(self._client_id, call_id, method, args)):
            self._calls.pop(call_id, None)
            if not fut.done():
                fut.set_exception(self._not_reading())
        return fut

    def _silent_for(self) -> float:
        """How long a shared core has said nothing (0 for a spawned one: its exit is watched)."""
        return 0.0 if self._owns_core else time.monotonic() - self._last_heard

    @property
    def _stale_after(self) -> float:
        return min(STALE_S, self.dead_timeout)

    def _abort(self, rids: list[str]) -> None:
        """Abort ``rids`` in the core. While it is silent they are also kept, to be sent again once
        it speaks; past ``dead_timeout`` only kept (nothing is sent to a core taken for dead)."""
        if self._closing:
            return
        silent = self._silent_for()
        if silent > self._stale_after:
            with self._orphans_lock:
                self._orphans.update(rids)
        if silent <= self.dead_timeout:
            self._send(Abort(rids, self._client_id))

    def _forget(self, rid: str) -> None:
        with self._streams_lock:
            self._streams.pop(rid, None)
        with self._outputs_lock:
            self._processor.drop(rid)

    # ---- EngineClient ----------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def errored(self) -> bool:
        """Shut down: no new requests (a dead spawned core is replaced, never "errored")."""
        return self._closing

    @property
    def restarting(self) -> bool:
        state = self._state
        stale = self._silent_for() > self._stale_after
        reloading = self._reloading > 0
        return self._respawning or reloading or stale or (state is not None and state.restarting)

    @property
    def retry_after(self) -> float:
        state = self._state
        return max(self._retry_after if self._respawning else 0.0, state.retry_after if state else 0.0, 1.0)

    @property
    def num_restarts(self) -> int:
        return self._respawns + (self._state.num_restarts if self._state else 0)

    def _check_available(self) -> None:
        if self._closing:
            raise EngineDeadError("The engine has stopped and cannot serve requests.")
        if self.restarting:
            raise EngineUnavailableError(
                "The engine is restarting after a failure; retry shortly.", self.retry_after
            )

    async def start(self) -> None:
        """Nothing to do: the core is up once the constructor returns."""

    async def shutdown(self, drain_timeout: float = 5.0) -> None:
        """Let in-flight requests finish for up to ``drain_timeout`` s, abort the rest, stop (a
        spawned core exits; a shared one only forgets this client)."""
        if self._closing:
            return
        self._stop.set()  # (a spawned core's restart that waits for it)
        if self._owns_core:
            self._send(Goodbye(self._client_id, shutdown=True, drain_timeout=drain_timeout))
            proc = self._proc
            self._stopping_core = True
            if proc is not None:
                try:
                    await asyncio.to_thread(proc.wait, drain_timeout + 30.0)
                except subprocess.TimeoutExpired:
                    logger.warning("lorastar: the engine core did not exit; killing it")
                    proc.kill()
                    await asyncio.to_thread(proc.wait)
        else:
            deadline = time.monotonic() + drain_timeout
            while self._streams and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            with self._streams_lock:
                rids = list(self._streams)
            if rids:
                self._abort(rids)
                end = time.monotonic() + 2.0
                while self._streams and time.monotonic() < end:
                    await asyncio.sleep(0.02)
            self._send(Goodbye(self._client_id))
        self._closing = True
        await asyncio.to_thread(self._thread.join, 5.0)
        self._fail_all(EngineDeadError("The engine was shut down."))
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._closing = True
        self._stop.set()
        self._stop_monitor()
        self._out.close(linger=0)
        with self._send_lock:
            self._in.close(linger=100 if not self._owns_core else 0)
        self._ctx.term()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        shutil.rmtree(self._tmp, ignore_errors=True)

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        *,
        adapter: str | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """As ``AsyncLLM.generate``: outputs of ``sampling_params.output_kind``; the last has
        ``finished=True``; closing the iterator early aborts the request in the core. ``priority``
        is checked by the core (its scheduling policy)."""
        self._check_available()
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            text, ids = await asyncio.to_thread(self.inputs.validate_prompt, prompt)
        else:
            text, ids = self.inputs.validate_prompt(prompt)
        if self._closing:  # shut down while the prompt was tokenized: its sockets are closed
            raise EngineDeadError("The engine was shut down.")
        rid = request_id or uuid.uuid4().hex
        wire = f"{rid}-{next(self._wire_ids)}"
        # Encoded before anything is registered: what msgspec cannot encode (a lone surrogate, an
        # int past 64 bits) leaves nothing behind and is the caller's error (400).
        check_priority_value(priority)
        data = self._encode_request(AddRequest(self._client_id, wire, ids, params, adapter, priority))
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._streams_lock:
            if self._open.get(rid) in self._streams:
                raise ValueError(f"request_id {rid!r} is already in use")
            self._streams[wire] = (asyncio.get_running_loop(), q)
            self._open[rid] = wire
        try:
            try:
                with self._outputs_lock:
                    self._processor.add_request(wire, text, ids, params, adapter)
                if not self._send_data(data):
                    raise self._not_reading()
            except BaseException:
                self._forget(wire)
                raise

            def abandon() -> None:
                self._forget(wire)
                self._abort([wire])

            delta = params.output_kind == RequestOutputKind.DELTA
            async with contextlib.aclosing(stream_outputs(q, delta, abandon, rid)) as outputs:
                async for out in outputs:
                    yield out
        finally:
            release_id(self._open, self._streams_lock, rid, wire)

    async def abort(self, request_id: str) -> None:
        with self._streams_lock:
            wire = self._open.get(request_id)
        if wire is not None:
            self._abort([wire])

    def _encode_request(self, msg: AddRequest) -> bytes:
        try:
            return self._enc.encode(msg)
        except (msgspec.EncodeError, OverflowError, UnicodeEncodeError, TypeError) as exc:
            field = self._unencodable_field(msg)
            raise InvalidParamError(
                field, f"{field or 'The request'} cannot be sent to the engine core: {exc}"
            ) from exc

    def _unencodable_field(self, msg: AddRequest) -> str | None:
        """The field of ``msg`` that msgspec cannot encode (the first one), if one alone is."""
        fields = [("request_id", msg.request_id), ("adapter", msg.adapter)]
        if dataclasses.is_dataclass(msg.params):
            fields += [(f.name, getattr(msg.params, f.name)) for f in dataclasses.fields(msg.params)]
        for name, value in fields:
            try:
                self._enc.encode(value)
            except Exception:  # noqa: BLE001 - any failure names the field
                return name
        return None

    async def load_adapter(self, name: str, path: str, *, new: bool = False) -> AdapterInfo:
        """``new``: refused (AdapterExistsError) if the core holds the name, whichever client loaded it."""
        self._check_available()
        args = [name, str(path)] + (["new"] if new else [])  # (Call.args are strings)
        info = msgspec.convert(await asyncio.wrap_future(self._start_call("load_adapter", args)), AdapterInfo)
        if name in self._row_names:  # (not where another client unloaded it since: the listing says)
            self._adapters[name] = info.path or str(path)  # loaded again should a shared core restart
        return info

    async def unload_adapter(self, name: str) -> None:
        self._check_available()
        await asyncio.wrap_future(self._start_call("unload_adapter", [name]))
        if name not in self._row_names:  # (not where another client loaded it again since)
            self._adapters.pop(name, None)

    async def reset_prefix_cache(self) -> bool:
        """``LLMEngine.reset_prefix_cache`` in the core (of every client of a shared one)."""
        self._check_available()
        return bool(await asyncio.wrap_future(self._start_call("reset_prefix_cache", [])))

    def list_adapters(self) -> list[AdapterInfo]:
        busy = self._state.adapters_in_flight if self._state is not None else {}
        return [dataclasses.replace(a, in_flight=busy[a.name]) if a.name in busy else a for a in self._rows]

    def has_adapter(self, name: str) -> bool:
        """Whether the core lists adapter ``name`` (``name in list_adapters()`` without the listing)."""
        return name in self._row_names

    def stats(self) -> EngineStats | None:
        """The counters the core sent last (at most ``STATE_EVERY_S`` old while it steps)."""
        state = self._state
        return None if state is None or self.restarting else state.stats

    @property
    def core_pid(self) -> int | None:
        """The spawned core's process id (``None`` for a shared core)."""
        return self._proc.pid if self._proc is not None else None


def _import_tokenizer_modules() -> None:
    """What ``load_tokenizer`` imports, so a frontend waiting for its core has it ready."""
    try:
        from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401
    except Exception:  # noqa: BLE001 - load_tokenizer raises it again where it matters
        pass
