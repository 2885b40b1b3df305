"""What the engine hands back to callers (vLLM's shapes), and what its core hands its frontend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: {token_id: Logprob} with the top-k and the sampled token.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestMetrics(msgspec.Struct, array_like=True, gc=False):
    """A request's engine timestamps (``time.monotonic``). A msgspec Struct rather than a dataclass:
    the core builds one per request and step and sends it to the frontend (at 256 running
    sequences 17 us to build and 7 us to encode a step's, against 52 and 41 as a dataclass)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    adapter: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: RequestMetrics | None = None
    # SamplingParams(embed=True): the last prompt token's final hidden state (not normalized)
    embedding: list[float] | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """vLLM's: one prompt's embedding."""

    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """vLLM's ``LLM.embed`` result: ``outputs.embedding`` is the last prompt token's final hidden
    state (the decoder models' "last" pooling), L2-normalized unless asked otherwise."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    adapter: str | None = None
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache


def embedding_result(out: RequestOutput, normalize: bool = True) -> EmbeddingRequestOutput:
    """An embedding request's final output as vLLM's ``EmbeddingRequestOutput``."""
    v = out.embedding or []
    return EmbeddingRequestOutput(
        out.request_id, EmbeddingOutput(normalized(v) if normalize else list(v)), out.prompt_token_ids,
        out.finished, out.adapter, out.num_cached_tokens,
    )  # fmt: skip


def normalized(v: list[float]) -> list[float]:
    """``v / ||v||_2`` (a zero vector as it is), in float64 arithmetic."""
    norm = sum(x * x for x in v) ** 0.5
    return [x / norm for x in v] if norm > 0 else list(v)


@dataclass(slots=True)
class BeamSearchSequence:
    """One hypothesis of ``LLM.beam_search`` (vLLM's): ``tokens`` hold the prompt's and the
    generated ids, ``logprobs`` one dict per generated token (the token and the top
    ``2 * beam_width``), ``text`` the decoded ``tokens`` (prompt included, as vLLM's)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """A prompt's ``beam_width`` best hypotheses, best first (vLLM's)."""

    sequences: list[BeamSearchSequence]


# ---- core -> frontend (engine/output_processor.py turns these into RequestOutputs) ----------------
# Per new token: (token_id, logprob, rank) for the top k and the sampled token.
RawLogprobs = list[tuple[int, float, int]]


class SampleDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One sample's step (``n > 1``: one of ``n``): its new token ids (beam search: every output
    token of a hypothesis), their logprobs when asked for, and how it finished in the core."""

    index: int
    token_ids: list[int]
    logprobs: list[RawLogprobs] | None = None
    cumulative_logprob: float | None = None  # beam search only (the frontend sums the rest)
    finish_reason: str | None = None  # "stop" (EOS, a stop token id) | "length" | "abort"
    stop_reason: int | str | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's step in the core (vLLM v1's shape): no text, no prompt; the frontend has
    the prompt and the tokenizer. ``whole``: the samples are beam hypotheses, replaced wholesale."""

    request_id: str
    samples: list[SampleDelta]
    finished: bool = False
    whole: bool = False
    num_cached_tokens: int = 0
    # Once, with the first output: per prompt position (None at 0) the prompt token's
    # (token_id, logprob, rank) first, then the top k.
    prompt_logprobs: list[RawLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    embedding: list[float] | None = None  # an embedding request's, with its final output
