"""Requests and their sequences (torch-free).

A ``Request`` is what a caller submitted (one prompt, one ``SamplingParams``); it owns one or
more ``Sequence``s — one while the prompt is prefilled, ``n`` after the first token when
``n > 1`` (children share the prompt's KV blocks, copy-on-write). The scheduler schedules
sequences; outputs are reported per request.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lorastar.errors import InvalidParamError

if TYPE_CHECKING:
    from lorastar.engine.sampling import SamplingParams

_seq_ids = itertools.count()


class OutputIds(Seq[int]):
    """A sequence's output token ids read in place, ``token_ids[start:]`` without the copy (a
    sampling row's view: copying every output token per row per step grows with the request)."""

    __slots__ = ("_end", "_ids", "_start")

    def __init__(self, token_ids: list[int], start: int, end: int | None = None) -> None:
        self._ids = token_ids
        self._start = start
        self._end = end  # None: to the list's end; else ``token_ids[start:end]`` (a drafted row's)

    def __len__(self) -> int:
        return (len(self._ids) if self._end is None else self._end) - self._start

    def __getitem__(self, i):  # noqa: ANN001, ANN204 - int or slice, as list's
        if isinstance(i, slice):
            return self._ids[self._start : self._end][i]
        n = len(self)
        if not -n <= i < n:
            raise IndexError("output index out of range")
        return self._ids[self._start + (i if i >= 0 else i + n)]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._ids, self._start, self._end)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int  # which of the request's n outputs
    token_ids: list[int]  # prompt + generated
    num_prompt_tokens: int
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    # Leading block_table entries the runner's persistent row holds as they are (engine/input_batch.py):
    # the block manager lowers it whenever it rewrites an entry in place; appends need nothing.
    block_table_synced: int = 0
    num_cached_blocks: int = 0  # leading blocks registered in (or taken from) the prefix cache
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    # Per generated token, when requested: (token_id, logprob, rank) of the top k and the sampled.
    logprobs: list[list[tuple[int, float, int]]] = field(default_factory=list)
    generator: Any = None  # torch.Generator for seeded sampling
    sampling_row: Any = None  # the sampler's view of this sequence (engine/sampler.py), built once
    num_preemptions: int = 0
    sent_tokens: int = 0  # output tokens handed to the frontend already
    # Async scheduling (engine.py): trailing ``token_ids`` entries that hold no token yet (sampled
    # on the device by a step still in flight), the row of the newest one in that step's sampled
    # ids, and whether the sequence ends with it whatever it is (it reaches max_tokens or the
    # context limit): the scheduler then schedules it no further.
    num_placeholders: int = 0
    placeholder_row: int = -1
    ends_pending: bool = False
    # Speculative decoding (engine.py): trailing ``token_ids`` entries that are drafted, not yet
    # verified. Only between the engine's proposal and its verification in the same step; a draft
    # is never hashed, computed into ``num_computed_tokens`` or sent out.
    num_draft_tokens: int = 0
    # The drafter's copy of ``token_ids`` (a numpy buffer grown by appends; its first
    # ``token_buf_len`` entries are current): a step copies only the new tokens, not the sequence.
    token_buf: Any = None
    token_buf_len: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def adapter_key(self) -> str | None:
        return self.request.adapter_key

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request.request_id}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table}, status={self.status.value})"
        )


def check_priority_value(priority: Any) -> None:
    """``InvalidParamError`` unless ``priority`` is an int in int64's range (what crosses to a core
    process; the engine also checks it against its scheduling policy)."""
    if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**63) <= priority < 2**63:
        raise InvalidParamError(
            "priority", f"priority must be an integer in [-2**63, 2**63), got {priority!r}"
        )


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter_name: str | None = None
    adapter_key: str | None = None  # the adapter's content hash: what the KV depends on
    adapter_entry: Any = None  # registry entry, released when the request ends
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower first, under the scheduler's "priority" policy (vLLM's meaning)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    sequences: list[Sequence] = field(default_factory=list)
    forked: bool = False  # n > 1: children created after the first token
    holds_sync: bool = False  # async scheduling runs steps one at a time while it is live
    reads_host: bool = False  # its sampling reads the output on the host (engine._reads_host)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    aborted: bool = False
    beam: Any = None  # BeamState when params.use_beam_search
    bad_words: Any = None  # sampler.BadWords: params.bad_words as token ids (None: none)
    choices: Any = None  # sampler.ChoicePaths: params.guided_choice as token paths (None: none)
    grammar: Any = None  # xgrammar CompiledGrammar of params' JSON schema / regex / grammar (None: none)
    # params.prompt_logprobs set: one entry per prompt position, None until its chunk has run
    # (position 0 stays None: nothing predicts it). Entries are PromptTokenLogprobs.
    prompt_logprobs: list[Any] | None = None
    num_outputs: int = 0  # outputs handed out (DELTA: only the first carries prompt_logprobs)
    # Prompt blocks handed to the prompt-logprobs cache so far, and the block-ending hidden rows
    # (position -> [hidden] tensor) waiting for their block's entries to complete.
    prompt_blocks_kept: int = 0
    prompt_hidden: dict[int, Any] = field(default_factory=dict)
    embedding: Any = None  # params.embed: the last prompt token's final hidden state ([hidden], fp32)

    def __post_init__(self) -> None:
        if not self.sequences:
            self.sequences.append(
                Sequence(
                    request=self,
                    index=0,
                    token_ids=list(self.prompt_token_ids),
                    num_prompt_tokens=len(self.prompt_token_ids),
                )
            )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        if self.beam is not None and not self.aborted:
            return self.beam.done and all(s.is_finished for s in self.sequences)
        if len(self.sequences) == 1 and self.params.n == 1:  # the common case, once per step
            return self.sequences[0].status is SeqStatus.FINISHED
        return (self.forked or self.params.n == 1 or self.aborted) and all(
            s.is_finished for s in self.sequences
        )
