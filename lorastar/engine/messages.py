"""The typed messages between a frontend and the engine core process (msgspec over zmq).

Frontend -> core (one PUSH per client into the core's bound PULL socket): ``Hello`` (a client
announces the address of its own output socket), ``AddRequest`` (token ids, already validated and
tokenized by the frontend), ``Abort``, ``FinishSamples`` (samples the frontend saw end on a stop
string), ``Call`` (adapter load/unload, answered by ``Reply``),
``Goodbye`` (a client leaves; ``shutdown=True`` also stops the core after draining).

Core -> frontend (one PUSH per client into the client's bound PULL socket): ``Ready`` (what the
frontend needs to tokenize and validate), ``Outputs`` (one step's ``EngineCoreOutput`` deltas for
this client's requests: token ids, raw logprobs, finish reasons; the frontend detokenizes them;
and the requests that failed), ``Reply``, ``State`` (counters, adapters, health; sent
after every change and as a heartbeat), ``StartupFailed``.

Outputs carry no prompt and no text: the frontend has the prompt and the tokenizer.
"""

from __future__ import annotations

from typing import Any

import msgspec

from lorastar.adapters.info import AdapterInfo
from lorastar.engine.metrics import EngineStats
from lorastar.engine.outputs import EngineCoreOutput
from lorastar.engine.sampling import SamplingParams
from lorastar.errors import (
    AdapterError,
    AdapterExistsError,
    AdapterNotFoundError,
    EngineDeadError,
    EngineOverloadedError,
    EngineUnavailableError,
    InvalidParamError,
    LimitExceededError,
    LoraStarError,
    RequestFailedError,
)


class ErrorInfo(msgspec.Struct):
    """An exception as it crosses the process boundary (``to_error`` rebuilds it)."""

    kind: str
    message: str
    param: str | None = None
    retry_after: float | None = None


# ---- frontend -> core --------------------------------------------------------------------------
class Hello(msgspec.Struct, tag=True):
    client_id: str
    output_address: str


class AddRequest(msgspec.Struct, tag=True):
    client_id: str
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    priority: int = 0


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]
    client_id: str = ""  # whose ids (clients of a shared core may use the same ids); "": any client's


class FinishSamples(msgspec.Struct, tag=True):
    """``(request_id, index, stop string)`` per sample that a stop string ended in the frontend."""

    samples: list[tuple[str, int, str]]
    client_id: str = ""  # as Abort's


class Call(msgspec.Struct, tag=True):
    client_id: str
    call_id: int
    method: str  # "load_adapter" | "unload_adapter" | "reset_prefix_cache"
    args: list[str]


class Goodbye(msgspec.Struct, tag=True):
    client_id: str
    shutdown: bool = False  # also stop the core (the client that spawned it)
    drain_timeout: float = 0.0


CoreInput = Hello | AddRequest | Abort | FinishSamples | Call | Goodbye


# ---- core -> frontend --------------------------------------------------------------------------
class State(msgspec.Struct, tag=True):
    core_id: str
    stats: EngineStats | None
    # The adapter listing (``in_flight`` 0 in each row), sent to a client only when it changed since
    # that client's last one: None = unchanged. Rebuilding and encoding it took 3 ms at 1,000 adapters.
    adapters: list[AdapterInfo] | None
    restarting: bool = False
    retry_after: float = 0.0
    num_restarts: int = 0
    adapters_in_flight: dict[str, int] = {}  # the listed names with requests in flight (the rest: 0)


class Ready(msgspec.Struct, tag=True):
    core_id: str
    model_name: str
    model_dir: str
    tokenizer_dir: str
    chat_template: str | None
    max_model_len: int
    max_prompt_bytes: int
    vocab_size: int
    summary: list[str]  # the start-up summary lines (engine/summary.py), computed in the core
    state: State
    max_waiting: int | None = None  # the core's bound on queued requests (EngineConfig.max_waiting)
    # The core had this client when its Hello came (a Hello again while it was silent). False for
    # one it had dropped (not reading its outputs): that client's open requests are gone.
    known_client: bool = False
    info: dict[str, Any] = msgspec.field(default_factory=dict)  # summary.engine_info: dtype, device...
    # generation_config.json's sampling defaults (engine/generation_config.py), for the frontend
    default_sampling: dict[str, Any] = msgspec.field(default_factory=dict)
    # the most top logprobs a request may ask for (EngineConfig.max_logprobs, resolved)
    max_logprobs: int = 20


class Outputs(msgspec.Struct, tag=True):
    outputs: list[EngineCoreOutput]
    failures: list[tuple[str, ErrorInfo]] = []
    # With a finished request: the counters as of this step, applied before the outputs are
    # handed out (a caller that saw its request finish reads counters that include it; one a
    # stop string ended in the frontend is counted once the core has its FinishSamples).
    state: State | None = None


class Reply(msgspec.Struct, tag=True):
    call_id: int
    result: Any = None
    error: ErrorInfo | None = None


class StartupFailed(msgspec.Struct, tag=True):
    error: ErrorInfo


CoreOutput = Ready | Outputs | Reply | State | StartupFailed


# ---- errors --------------------------------------------------------------------------------------
_ERRORS: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (
        LoraStarError, InvalidParamError, LimitExceededError, AdapterError, AdapterExistsError, AdapterNotFoundError,
        EngineOverloadedError, EngineDeadError, EngineUnavailableError, RequestFailedError,
        ValueError, KeyError, TypeError, RuntimeError, FileNotFoundError, PermissionError,
    )
}  # fmt: skip


def error_info(exc: BaseException) -> ErrorInfo:
    kind = next((c.__name__ for c in type(exc).__mro__ if c.__name__ in _ERRORS), "RuntimeError")
    message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return ErrorInfo(kind, message, getattr(exc, "param", None), getattr(exc, "retry_after", None))


def to_error(info: ErrorInfo) -> BaseException:
    cls = _ERRORS.get(info.kind, RuntimeError)
    if issubclass(cls, InvalidParamError):
        return cls(info.param, info.message)
    if issubclass(cls, EngineUnavailableError):
        return cls(info.message, info.retry_after if info.retry_after is not None else 1.0)
    return cls(info.message)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def input_decoder() -> msgspec.msgpack.Decoder[CoreInput]:
    return msgspec.msgpack.Decoder(CoreInput)


def output_decoder() -> msgspec.msgpack.Decoder[CoreOutput]:
    return msgspec.msgpack.Decoder(CoreOutput)
