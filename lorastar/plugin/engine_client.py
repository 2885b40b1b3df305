"""``EngineClient``: what the plugin's routes and service need from an engine.

``AsyncLLM`` and ``AsyncCoreClient`` (the core in its own process) implement it; the tests' fake
engine does too. Routes are typed against this protocol instead of ``Any``, so a renamed engine
method fails type checks and the protocol test, not a request at run time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from lorastar.adapters.info import AdapterInfo
from lorastar.engine.metrics import EngineStats
from lorastar.engine.outputs import RequestOutput
from lorastar.engine.sampling import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: Any  # a transformers tokenizer (decode, encode, chat template)
    model_name: str
    max_model_len: int
    vocab_size: int
    max_logprobs: int  # most top logprobs a request may ask for (EngineConfig.max_logprobs, resolved)
    max_waiting: int | None  # most requests queued at once (None: no bound); a larger batch never fits
    errored: bool  # stopped for good: 503 until restarted
    restarting: bool  # a failed step is being recovered from: 503 + Retry-After
    retry_after: float  # seconds, while restarting

    async def start(self) -> None: ...

    async def shutdown(self, drain_timeout: float = 5.0) -> None: ...

    def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        *,
        adapter: str | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; the last has ``finished=True``. Closing it aborts.
        ``priority``: lower first under the engine's priority scheduling (``InvalidParamError``
        when it is not 0 and the engine schedules first come, first served)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool:
        """Whether any request is still open (the shutdown drain waits on this)."""
        ...

    def fail_streams(self, exc: BaseException) -> int:
        """End every open request by raising ``exc`` in its stream (the request is aborted); how many."""
        ...

    async def load_adapter(self, name: str, path: str, *, new: bool = False) -> AdapterInfo | None:
        """``new``: refuse (``AdapterExistsError``) a name the engine already holds."""
        ...

    async def unload_adapter(self, name: str) -> None: ...

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing forgotten) while a request holds blocks."""
        ...

    def list_adapters(self) -> Sequence[AdapterInfo]: ...

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Blocking; refuses text over the engine's ``max_prompt_bytes`` before tokenizing."""
        ...

    def check_prompt_size(self, text: str | list[str], param: str = "prompt") -> None:
        """``LimitExceededError`` when the text is over ``max_prompt_bytes`` (before tokenizing)."""
        ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        *,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
    ) -> list[int]: ...

    def stats(self) -> EngineStats | None: ...
