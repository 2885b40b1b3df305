"""The engine core in its own process: schedule -> run -> sample, and nothing else of the server.

Why a process: in one interpreter the HTTP layer (JSON, SSE, asyncio) and the step loop take turns
on one GIL, so each streamed token's HTTP work delays the next step (benchmarks/serving.py). Here the
frontend (``AsyncCoreClient``, engine/core_client.py) tokenizes, validates and serves HTTP in its
process; this one only steps the engine and sends each step's outputs as ``msgspec`` messages.

One thread: between steps it drains its input socket without blocking (while idle it blocks up to
``IDLE_POLL_S``), applies adds, aborts and calls, runs one ``LLMEngine.step`` and sends the outputs
to the clients that own the requests (several frontends, e.g. app workers, may share one core).
Adapter loads read and validate their files on a worker thread (``LLMEngine.load_adapter`` takes the
engine lock only to register); their replies are sent by this thread once done.

Sends to a shared core's clients never block this thread: a client whose output pipe is full
(``CLIENT_HWM`` messages it has not read: killed without a ``Goodbye``, or stuck) is dropped as if it
had said ``Goodbye`` (its requests aborted, later ones refused); should it say ``Hello`` again, its
``Ready`` tells it that its requests are gone (``Ready.known_client``). A spawned core waits for its
one client, the parent (it exits with it).

A step that raises is recovered from as in ``AsyncLLM`` (``rebuild_engine``): its started requests
fail, the engine is rebuilt, queued requests move over. Clients see ``State.restarting`` meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq

from lorastar.adapters.info import AdapterInfo
from lorastar.config import EngineConfig
from lorastar.engine.async_engine import rebuild_engine
from lorastar.engine.engine import LLMEngine, aborted_samples
from lorastar.engine.messages import (
    Abort,
    AddRequest,
    Call,
    CoreInput,
    ErrorInfo,
    FinishSamples,
    Goodbye,
    Hello,
    Outputs,
    Ready,
    Reply,
    StartupFailed,
    State,
    encoder,
    error_info,
    input_decoder,
)
from lorastar.engine.outputs import EngineCoreOutput
from lorastar.engine.summary import engine_info, engine_summary
from lorastar.engine.threads import submit_to_fresh_thread
from lorastar.errors import EngineUnavailableError

logger = logging.getLogger("lorastar")

IDLE_POLL_S = 0.05  # how long an idle core blocks on its input before checking jobs and heartbeats
STATE_EVERY_S = 0.1  # State is sent at most this often while stepping (counters for /metrics)
# The state without the adapter listing, the listing's key (None while restarting) and its rows.
_Current = tuple[State, tuple[int, int] | None, list[AdapterInfo]]
HEARTBEAT_S = 1.0  # and at least this often while idle (clients judge the core alive by it)
RESTART_BACKOFF = (0.5, 30.0)
CLIENT_HWM = 1000  # messages queued for a client that does not read before it counts as gone


class EngineCoreProc:
    """Serves one ``LLMEngine`` to the clients that connect to ``input_address``."""

    def __init__(self, config: EngineConfig, input_address: str, *, report_to: str | None = None) -> None:
        self.config = config
        self.core_id = uuid.uuid4().hex
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.bind(input_address)  # before the model loads: clients may connect and queue
        self.enc = encoder()
        self.dec = input_decoder()
        self.clients: dict[str, zmq.Socket] = {}
        self.gone: set[str] = set()  # clients whose output pipe filled up, to drop between steps
        self.report_to = report_to
        self.parent: str | None = None  # a spawned core's client (its output address is report_to)
        self.owner: dict[str, str] = {}  # engine request id -> client id
        # Clients choose their request ids: one that another client's request holds runs under an
        # engine id of its own (as vLLM's internal request ids), mapped back in what it is sent.
        self.alias: dict[tuple[str, str], str] = {}  # (client id, its request id) -> engine id
        self.client_rid: dict[str, tuple[str, str]] = {}  # engine id -> its key in alias
        # adapter loads under way: the call, the engine it loads into, its thread's future
        self.jobs: deque[tuple[Call, LLMEngine, concurrent.futures.Future[Any]]] = deque()
        # Requests whose JSON schema / regex / grammar compiles: xgrammar releases the GIL, and a
        # long maxLength alone took 1.4 s on this VM, so it compiles off the step loop (as vLLM
        # does) and only that request waits.
        self.compiling: list[tuple[AddRequest, concurrent.futures.Future[Any]]] = []
        self.grammar_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lorastar-grammar")
        self.stop = threading.Event()
        self.drain_deadline: float | None = None
        self.restarting = False
        self.retry_after = 0.0
        self.num_restarts = 0
        self._state_sent = 0.0
        # client -> (num_restarts, registry.listing_version) of the adapter listing it was last sent
        self._listing_sent: dict[str, tuple[int, int]] = {}
        try:
            # Its frontends tokenize: a spawned core loads the tokenizer while it already serves
            # (TokenizerLoader); a shared one (`lorastar engine`) loads it first, so a folder without
            # one fails its start instead of every client's.
            lazy = report_to is not None
            self.engine = LLMEngine(config, lazy_tokenizer=lazy)
            if lazy:
                self.engine.tokenizer_loader.load_in_background()
        except BaseException as exc:
            if report_to is not None:
                sock = self._connect(report_to)
                sock.send(self.enc.encode(StartupFailed(error_info(exc))))
                sock.close(linger=2000)
            self.close()
            raise

    # ---- sockets --------------------------------------------------------------------------------
    def _connect(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, CLIENT_HWM)
        sock.connect(address)
        return sock

    def _send(self, client_id: str, msg: Any) -> None:
        if client_id in self.clients:
            self._push(client_id, self.enc.encode(msg))

    def _push(self, client_id: str, data: Any) -> None:
        """Send without blocking: this thread serves every client, and a blocking send to one that
        is gone (its pipe full) would stop the core for all of them. Such a client gets nothing
        more; the loop drops it between steps (``_drop_gone``: this may run inside a step)."""
        sock = self.clients.get(client_id)
        if sock is None:
            return
        if client_id == self.parent:  # the only client; its outputs are never dropped
            sock.send(data, copy=False)
            return
        try:
            sock.send(data, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.warning("lorastar: engine core dropped client %s (not reading its outputs)", client_id)
            del self.clients[client_id]
            sock.close(linger=0)
            self.gone.add(client_id)

    def _drop_gone(self) -> None:
        while self.gone:
            self._drop_client(self.gone.pop())

    def _drop_client(self, client_id: str, linger: int | None = 0) -> None:
        """Forget a client (its ``Goodbye``, or it stopped reading): abort its requests."""
        self.gone.discard(client_id)
        for rid in [r for r, c in self.owner.items() if c == client_id]:
            self.engine.abort_core_request(rid)
            del self.owner[rid]
        self._drop_compiling(lambda m: m.client_id != client_id)
        self._listing_sent.pop(client_id, None)
        for key in [k for k in self.alias if k[0] == client_id]:
            self.client_rid.pop(self.alias.pop(key), None)
        if (sock := self.clients.pop(client_id, None)) is not None:
            sock.close(linger=linger)

    def _broadcast_state(self) -> None:
        self._state_sent = time.monotonic()
        if not self.clients:
            return
        current = self._current_state()
        encoded: dict[bool, Any] = {}  # with the adapter listing or without: two encodings at most
        for client_id in list(self.clients):  # _push may drop one
            state = self._state_for(client_id, current)
            full = state.adapters is not None
            if full not in encoded:
                encoded[full] = self.enc.encode(state)
            self._push(client_id, encoded[full])

    def state(self, client_id: str | None = None) -> State:
        """The state as ``client_id`` gets it (the adapter listing only where that client does not
        hold this version of it); ``None``: with the listing."""
        return self._state_for(client_id, self._current_state())

    def _current_state(self) -> _Current:
        """The state without the listing, the listing's key (``None`` while restarting) and rows."""
        if self.restarting:
            self._listing_sent.clear()  # the rebuilt engine's listing goes to every client
            return State(self.core_id, None, [], True, self.retry_after, self.num_restarts), None, []
        eng = self.engine
        version, rows = eng.registry.listing()
        state = State(
            self.core_id, eng.stats(), None, False, self.retry_after, self.num_restarts,
            eng.registry.in_flight_by_name(),
        )  # fmt: skip
        return state, (self.num_restarts, version), rows

    def _state_for(self, client_id: str | None, current: _Current) -> State:
        state, key, rows = current
        if key is None:
            return state
        if client_id is not None:
            if self._listing_sent.get(client_id) == key:
                return state
            # A send that fails drops the client, which starts afresh (Hello -> Ready, full listing).
            self._listing_sent[client_id] = key
        return msgspec.structs.replace(state, adapters=rows)

    def ready(self, client_id: str | None = None, known_client: bool = False) -> Ready:
        eng = self.engine
        self._listing_sent.pop(client_id, None)  # type: ignore[arg-type]  # (Ready: the whole listing)
        return Ready(
            self.core_id, eng.model_name, str(eng.model_dir), str(eng.tokenizer_dir), self.config.chat_template,
            eng.max_model_len, eng.max_prompt_bytes, eng.vocab_size, engine_summary(eng),
            self.state(client_id), self.config.max_waiting, known_client, engine_info(eng), eng.default_sampling,
            eng.max_logprobs,
        )  # fmt: skip

    # ---- request ids ----------------------------------------------------------------------------
    def _own_id(self, msg: AddRequest) -> AddRequest:
        """``msg`` under an engine id of its own where another client's request holds its id."""
        rid = msg.request_id
        holder = self.owner.get(rid)
        if holder is None:
            holder = next((m.client_id for m, _ in self.compiling if m.request_id == rid), None)
        if holder is None or holder == msg.client_id or msg.client_id not in self.clients:
            return msg  # (a client reusing its own open id is refused, as by AsyncLLM)
        engine_id = f"{rid}-{uuid.uuid4().hex[:8]}"
        self.alias[(msg.client_id, rid)] = engine_id
        self.client_rid[engine_id] = (msg.client_id, rid)
        msg.request_id = engine_id
        return msg

    def _engine_ids(self, client_id: str, rids: Sequence[str]) -> list[str]:
        """The engine ids of ``client_id``'s ``rids`` that it owns (all for a legacy ``""``)."""
        if not client_id:
            return list(rids)
        ids = [self.alias.get((client_id, rid), rid) for rid in rids]
        return [r for r in ids if self.owner.get(r, client_id) == client_id]

    def _their_id(self, engine_id: str, *, done: bool = False) -> str:
        """The client's own id of ``engine_id``; ``done``: the request is over (its alias goes)."""
        key = self.client_rid.pop(engine_id, None) if done else self.client_rid.get(engine_id)
        if key is None:
            return engine_id
        if done:
            self.alias.pop(key, None)
        return key[1]

    # ---- inputs ---------------------------------------------------------------------------------
    def _handle(self, msg: CoreInput) -> None:
        if isinstance(msg, AddRequest):
            self._add(self._own_id(msg))
        elif isinstance(msg, Abort):
            rids = self._engine_ids(msg.client_id, msg.request_ids)
            if self.compiling:
                gone, sender = set(rids), msg.client_id

                def keep(m: AddRequest) -> bool:
                    return m.request_id not in gone or bool(sender) and m.client_id != sender

                for m in self._drop_compiling(keep):
                    # ended as an aborted running request is (_core_output): n samples, "abort"
                    out = EngineCoreOutput(
                        self._their_id(m.request_id, done=True), aborted_samples(m.params), True
                    )
                    self._send(m.client_id, Outputs([out], state=self.state(m.client_id)))
            for rid in rids:
                out = self.engine.abort_core_request(rid)
                if out is not None:
                    self._deliver([out])
                if self.owner.pop(rid, None) is not None:
                    self._their_id(rid, done=True)
        elif isinstance(msg, FinishSamples):
            for rid, index, stop in msg.samples:
                if not (own := self._engine_ids(msg.client_id, [rid])):
                    continue
                out = self.engine.finish_sample(own[0], index, stop)
                if out is not None:  # the frontend ended it already; this updates the counters
                    self._deliver([out])
        elif isinstance(msg, Call):
            self._call(msg)
        elif isinstance(msg, Hello):
            self._drop_gone()  # a dropped client that comes back starts afresh
            old = self.clients.pop(msg.client_id, None)
            if old is not None:
                old.close(linger=0)
            self.clients[msg.client_id] = self._connect(msg.output_address)
            if self.report_to is not None and msg.output_address == self.report_to:
                self.parent = msg.client_id
            self._send(msg.client_id, self.ready(msg.client_id, known_client=old is not None))
        elif isinstance(msg, Goodbye):
            if msg.shutdown:  # the owner: in-flight requests drain, then the rest are aborted
                self.drain_deadline = time.monotonic() + msg.drain_timeout
                return
            self._drop_client(msg.client_id, linger=None)  # None: the socket's LINGER

    def _add(self, msg: AddRequest, grammar: Any = None, prepared: bool = False) -> None:
        if msg.client_id not in self.clients:  # dropped (or no Hello): its Hello again tells it
            return
        if (
            not prepared
            and self.drain_deadline is None
            and (
                msg.params.grammar_spec is not None
                or (msg.adapter is not None and self.engine.registry.on_disk(msg.adapter))
            )
        ):  # a grammar to compile or an adapter to read from disk: off the step loop, then queued
            self.compiling.append((msg, self.grammar_pool.submit(self._prepare, msg)))
            return
        try:
            if self.drain_deadline is not None:
                raise EngineUnavailableError("The engine is shutting down.", 1.0)
            self.engine.add_core_request(
                msg.prompt_token_ids, msg.params, adapter=msg.adapter, request_id=msg.request_id,
                grammar=grammar, priority=msg.priority,
            )  # fmt: skip
        except Exception as exc:  # validation, overload, unknown adapter: the client raises it
            rid = self._their_id(msg.request_id, done=True)
            self._send(msg.client_id, Outputs([], [(rid, error_info(exc))]))
            return
        self.owner[msg.request_id] = msg.client_id

    def _finish_compiles(self) -> None:
        """Queue the requests whose grammar has compiled (in arrival order among them); a grammar
        that failed to compile is the request's error."""
        if not any(fut.done() for _, fut in self.compiling):
            return
        pending = []
        for msg, fut in self.compiling:
            if not fut.done():
                pending.append((msg, fut))
            elif (exc := fut.exception()) is not None:
                rid = self._their_id(msg.request_id, done=True)
                self._send(msg.client_id, Outputs([], [(rid, error_info(exc))]))
            else:
                self._add(msg, fut.result(), prepared=True)
        self.compiling = pending

    def _prepare(self, msg: AddRequest) -> Any:
        """On the grammar thread: read the request's adapter into host memory if it is on disk (a
        read under the engine's lock stalls every running request), compile its grammar; the grammar."""
        if msg.adapter is not None:
            self.engine.preload_adapter(msg.adapter)
        return self.engine.compile_grammar(msg.params) if msg.params.grammar_spec is not None else None

    def _drop_compiling(self, keep: Callable[[AddRequest], bool]) -> list[AddRequest]:
        """Forget the compiling requests ``keep`` refuses (aborted; their client left); them."""
        dropped = [m for m, _ in self.compiling if not keep(m)]
        self.compiling = [(m, f) for m, f in self.compiling if keep(m)]
        return dropped

    def _call(self, msg: Call) -> None:
        if msg.method == "load_adapter" and len(msg.args) in (2, 3):
            # A thread that exits with the load: no second OpenMP pool stays (engine/threads.py).
            load = functools.partial(self.engine.load_adapter, new=msg.args[2:] == ["new"])
            fut = submit_to_fresh_thread(load, msg.args[0], msg.args[1], thread_name="lorastar-adapter-load")
            self.jobs.append((msg, self.engine, fut))
            return
        reply = Reply(msg.call_id)
        try:
            if msg.method == "unload_adapter" and len(msg.args) == 1:
                self.engine.unload_adapter(msg.args[0])
            elif msg.method == "reset_prefix_cache" and not msg.args:
                reply.result = self.engine.reset_prefix_cache()
            else:
                raise ValueError(f"unknown call {msg.method!r} with {len(msg.args)} arguments")
        except Exception as exc:
            reply.error = error_info(exc)
        self._broadcast_state()  # the adapter list changed before the caller hears back
        self._send(msg.client_id, reply)

    def _finish_jobs(self) -> None:
        while self.jobs and self.jobs[0][2].done():
            call, eng, fut = self.jobs.popleft()
            exc = fut.exception() if not fut.cancelled() else RuntimeError("cancelled")
            if exc is None and eng is not self.engine and call.args[0] not in self.engine.registry:
                # Registered into an engine a failed step replaced, after the rebuild took its
                # adapters: loaded again into this one (the caller hears of that load).
                self._call(call)
                continue
            reply = Reply(
                call.call_id, fut.result() if exc is None else None, error_info(exc) if exc else None
            )
            self._broadcast_state()
            self._send(call.client_id, reply)

    def _drain_inputs(self, timeout_ms: int) -> None:
        if not self.input.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.input.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._handle(self.dec.decode(frame.buffer))
            except msgspec.DecodeError as exc:
                logger.error("lorastar: engine core dropped a malformed message: %s", exc)
                self._refuse_malformed(frame.buffer, exc)
            except Exception:  # one bad message must not stop the core
                logger.exception("lorastar: engine core could not handle a message")

    def _refuse_malformed(self, buf: Any, exc: Exception) -> None:
        """Answer a malformed call or request (a worker of another lorastar version) that its sender
        waits for, when its ids can still be read: else that caller waited forever."""
        try:
            raw = msgspec.msgpack.decode(buf)
        except msgspec.DecodeError:
            return
        client = raw.get("client_id") if isinstance(raw, dict) else None
        if not isinstance(client, str):
            return
        info = ErrorInfo(
            "RuntimeError", f"the engine core could not read this message (another lorastar version?): {exc}"
        )
        if raw.get("type") == "Call" and isinstance(call_id := raw.get("call_id"), int):
            self._send(client, Reply(call_id, error=info))
        elif raw.get("type") == "AddRequest" and isinstance(rid := raw.get("request_id"), str):
            self._send(client, Outputs([], [(rid, info)]))

    # ---- outputs --------------------------------------------------------------------------------
    def _deliver(self, outs: list[EngineCoreOutput], failures: Sequence[tuple[str, ErrorInfo]] = ()) -> None:
        by_client: dict[str, Outputs] = {}
        for out in outs:
            client = self.owner.pop(out.request_id, None) if out.finished else self.owner.get(out.request_id)
            if client is None:
                continue
            if self.client_rid:
                out.request_id = self._their_id(out.request_id, done=out.finished)
            by_client.setdefault(client, Outputs([])).outputs.append(out)
        for rid, info in failures:
            client = self.owner.pop(rid, None)
            if client is not None:
                by_client.setdefault(client, Outputs([])).failures.append(
                    (self._their_id(rid, done=True), info)
                )
        if any(o.finished for o in outs) or failures:
            current = self._current_state()
            for client, msg in by_client.items():
                msg.state = self._state_for(client, current)
        for client, msg in by_client.items():
            self._send(client, msg)

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        """Step until a ``Goodbye(shutdown=True)`` drained, or ``stop`` is set."""
        try:
            while not self.stop.is_set():
                busy = self.engine.has_unfinished()
                waiting = self.jobs or self.compiling
                self._drain_inputs(0 if busy else (10 if waiting else int(IDLE_POLL_S * 1000)))
                self._drop_gone()
                self._finish_jobs()
                self._finish_compiles()
                if self.drain_deadline is not None and (
                    not self.engine.has_unfinished() or time.monotonic() >= self.drain_deadline
                ):
                    self._deliver([o for rid in list(self.engine.requests)
                                   if (o := self.engine.abort_core_request(rid)) is not None])  # fmt: skip
                    return
                if self.engine.has_unfinished():
                    self._step()
                now = time.monotonic()
                if now - self._state_sent >= (STATE_EVERY_S if busy else HEARTBEAT_S):
                    self._broadcast_state()
        finally:
            self.close()

    def _step(self) -> None:
        try:
            self._deliver(self.engine.step_core())
        except Exception as exc:
            logger.exception("lorastar: engine step failed; rebuilding the engine")
            self.restarting = True
            self._broadcast_state()

            def fail(rid: str, e: BaseException) -> None:  # told at once, not after the rebuild
                self._deliver([], [(rid, error_info(e))])

            def waiting(delay: float) -> None:
                self.retry_after = delay
                self._broadcast_state()

            new = rebuild_engine(
                self.engine, self.config, fail=fail, stop=self.stop, delay=RESTART_BACKOFF[0],
                cap=RESTART_BACKOFF[1], on_wait=waiting, core_only=True,
            )  # fmt: skip
            if new is None:
                return
            self.engine = new
            self.num_restarts += 1
            self.restarting = False
            self.retry_after = 0.0
            self._broadcast_state()
            logger.warning("lorastar: engine rebuilt after a failed step (%s)", type(exc).__name__)

    def close(self) -> None:
        self.grammar_pool.shutdown(wait=False, cancel_futures=True)
        for sock in self.clients.values():
            sock.close(linger=1000)
        self.clients.clear()
        self.input.close(linger=0)
        self.ctx.term()


def run_engine_core(
    config: EngineConfig,
    input_address: str,
    report_to: str | None = None,
    on_ready: Callable[[EngineCoreProc], None] | None = None,
) -> None:
    """Entry point of a spawned core process (and of ``lorastar engine``, whose ``on_ready`` logs
    that the model is in).

    A spawned core leaves SIGINT and SIGTERM to its parent: Ctrl-C in a terminal (or systemd's stop)
    signals the whole process group, and the parent's shutdown drains open requests through this
    core before its ``Goodbye`` stops it; the core ends at once when the parent is gone."""
    if report_to is not None:  # spawned by a client: die with the parent (no orphaned model in memory)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        _exit_with_parent()
    try:
        core = EngineCoreProc(config, input_address, report_to=report_to)
    except KeyboardInterrupt:  # Ctrl-C while the model loads (lorastar engine): no traceback
        raise
    except ValueError:  # the options against the model: said in one line, not a traceback
        if report_to is None:
            raise  # `lorastar engine` says it
        logger.debug("lorastar: the engine core failed to start", exc_info=True)
        raise SystemExit(1) from None  # its client raises the error it was sent
    except BaseException:
        logger.exception("lorastar: the engine core failed to start")
        raise SystemExit(1) from None
    if on_ready is not None:
        on_ready(core)
    core.run()


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="lorastar-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    """``python -m lorastar.engine.core_proc --config-file F --address A [--report-to B]``: how a
    client spawns its core (the config is a pickled ``EngineConfig`` the client wrote)."""
    import argparse
    import pickle

    p = argparse.ArgumentParser(prog="lorastar-engine-core")
    p.add_argument("--config-file", required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--report-to", default=None)
    a = p.parse_args(argv)
    with open(a.config_file, "rb") as f:
        config = pickle.load(f)  # noqa: S301 -- written by the parent process, in its private folder
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s core: %(message)s")
    run_engine_core(config, a.address, a.report_to)


if __name__ == "__main__":
    main()
