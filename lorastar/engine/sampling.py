"""Per-request sampling parameters (vLLM's ``SamplingParams`` names and meanings).

Torch-free: the scheduler, the request objects and the plugin's schema layer import it.
Every validation error is a ``ValueError`` whose message starts with the field's name,
so the HTTP layer can report it as ``param``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Temperatures below this are treated as greedy (vLLM's _SAMPLING_EPS).
_SAMPLING_EPS = 1e-5
# vLLM's OpenAI server caps top-logprobs at 20.
MAX_LOGPROBS = 20


def _is_int(x: object) -> bool:
    # bool is a subclass of int; True is never a meaningful count or seed.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """How to sample one request. Defaults match vLLM (top_k=0 means off)."""

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off (-1 is normalized to 0)
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None  # normalized to list[str]
    stop_token_ids: list[int] | None = None  # normalized to list[int]
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-k logprobs per generated token (0: only the sampled one)
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    length_penalty: float = 1.0  # only meaningful with beam search
    skip_special_tokens: bool = True
    min_tokens: int = 0  # EOS / stop_token_ids are masked until this many tokens are generated

    def __post_init__(self) -> None:
        # --- counts ---
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}.")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}.")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}.")

        # --- floats: accept ints, store floats ---
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "length_penalty",
        ):
            value = getattr(self, name)
            if not _is_number(value) or value != value:  # value != value: NaN
                raise ValueError(f"{name} must be a number, got {value!r}.")
            setattr(self, name, float(value))
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:  # current vLLM: any positive value (1.0 = off)
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")

        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(
                f"top_k must be -1 (disable), 0 (disable) or a positive integer, got {self.top_k!r}."
            )
        if self.top_k == -1:
            self.top_k = 0

        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}.")

        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}."
            )

        # --- stops ---
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)):
            stop = list(stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}.")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {s!r}.")
        self.stop = stop

        ids = self.stop_token_ids
        if ids is None:
            ids = []
        elif isinstance(ids, (list, tuple)):
            ids = list(ids)
        else:
            raise ValueError(f"stop_token_ids must be a list of integers, got {type(ids).__name__}.")
        for t in ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must contain only non-negative integers, got {t!r}.")
        self.stop_token_ids = ids

        for name in ("ignore_eos", "include_stop_str_in_output", "use_beam_search", "skip_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a boolean, got {value!r}.")

    # ------------------------------------------------------------------ helpers

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a mapping; an unknown key is an error naming it.

        A ``None`` value means "the default" (JSON bodies send ``null`` for unset fields).
        """
        names = set(cls.field_names())
        for key in d:
            if key not in names:
                raise ValueError(f"unknown sampling field {key!r}")
        return cls(**{k: v for k, v in d.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: copy.copy(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def clone(self) -> SamplingParams:
        # Lists (stop, stop_token_ids) are copied so the clone can be mutated independently.
        return dataclasses.replace(
            self, stop=list(self.stop or []), stop_token_ids=list(self.stop_token_ids or [])
        )
