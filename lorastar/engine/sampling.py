"""Per-request sampling parameters (vLLM's ``SamplingParams`` names and meanings).

Torch-free: the scheduler, the request objects and the plugin's schema layer import it.
Every validation error is an ``InvalidParamError`` (a ``ValueError``) whose ``param`` names the
field, and whose message starts with it. Every numeric field has a finite range.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lorastar.errors import InvalidParamError, LimitExceededError

# Temperatures below this are treated as greedy (vLLM's _SAMPLING_EPS).
_SAMPLING_EPS = 1e-5
MAX_CACHE_SALT = 1024  # characters (vLLM suggests 43: 256 random bits in base64)
# Deepest JSON schema taken (objects and arrays in the document): xgrammar's parse grows faster than
# cubically with nesting (on this VM 9 ms at 50 levels of "items", 0.55 s at 200, 5.5 s at 400);
# schemas nest through $defs / $ref, so real ones stay far below this.
MAX_SCHEMA_DEPTH = 64
# The structured-output fields: at most one per request.
MAX_THINKING_MESSAGE = 64  # thinking_budget_message_ids: a sentence, not a second answer
GUIDED_FIELDS = (
    "guided_choice", "guided_json", "guided_regex", "guided_grammar", "guided_json_object", "guided_structural_tag",
)  # fmt: skip


# Finite ranges of the float fields. vLLM's where it has one (top_p, min_p, presence and
# frequency penalties); the others are bounded so float32 sampler arithmetic stays finite:
# beyond temperature 100 the distribution is uniform to float32 precision anyway, and a
# repetition penalty outside [0.01, 100] divides logits into overflow.
_FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 100.0),
    "top_p": (0.0, 1.0),  # 0 itself refused below: (0, 1]
    "min_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.01, 100.0),
    "length_penalty": (-10.0, 10.0),  # an exponent of the generated length in beam scores
}
_MAX_INT = 2**63 - 1  # counts and token ids fit an int64 tensor
# torch.Generator.manual_seed accepts [-2**63, 2**64 - 1].
_MIN_SEED, _MAX_SEED = -(2**63), 2**64 - 1


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if not _is_int(value) or value < lo:  # type: ignore[operator]
        raise InvalidParamError(name, f"{name} must be an integer >= {lo}, got {value!r}.")
    if value > hi:  # type: ignore[operator]
        raise InvalidParamError(name, f"{name} must be an integer <= {hi}, got {value!r}.")


def _is_int(x: object) -> bool:
    # bool is a subclass of int; True is never a meaningful count or seed.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_text(x: object) -> bool:
    """A non-empty string that is valid Unicode (a lone surrogate, which Python's API lets in and
    JSON does not, cannot be tokenized or sent to an engine process)."""
    if not isinstance(x, str) or not x:
        return False
    try:
        x.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class RequestOutputKind(enum.IntEnum):
    """What each of a request's outputs carries (vLLM's kinds and values)."""

    CUMULATIVE = 0  # everything so far, every step (texts, ids and logprobs grow)
    DELTA = 1  # only what is new since the previous output (streams); the first holds prompt_logprobs
    FINAL_ONLY = 2  # nothing until the request finishes, then one complete output


@dataclass
class BeamSearchParams:
    """vLLM's parameters of ``LLM.beam_search``. The search is the engine's (HF transformers' beam
    search, ``engine/beam.py``) over raw log-probabilities, so ``temperature`` changes nothing, as
    in vLLM's v1 engine, whose beam scores are raw logprobs too."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False


def embedding_params() -> SamplingParams:
    """An embedding request's parameters: one greedy token (no result), its final output only."""
    return SamplingParams(max_tokens=1, temperature=0.0, embed=True, output_kind=RequestOutputKind.FINAL_ONLY)


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
    # Top-k logprobs of every prompt position after the first, plus the prompt token's own
    # (vLLM's ``prompt_logprobs``; 0: only the prompt token's). Raw model logprobs, computed
    # chunk by chunk during prefill; such a request uses the prefix cache only where those
    # positions' logprobs were kept (engine/prompt_logprobs.py).
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    length_penalty: float = 1.0  # only meaningful with beam search
    skip_special_tokens: bool = True
    min_tokens: int = 0  # EOS / stop_token_ids are masked until this many tokens are generated
    # {token_id: bias} added to the logits before penalties and sampling (OpenAI's logit_bias;
    # values clamped to [-100, 100] as OpenAI documents). Logprobs stay those of the raw logits.
    logit_bias: dict[int, float] | None = None
    # Only these token ids can be sampled (vLLM's allowed_token_ids: every other logit is -inf
    # before sampling; logprobs stay those of the raw logits). Not with beam search.
    allowed_token_ids: list[int] | None = None
    # Words never generated (vLLM's bad_words): each word's token ids, with and without a leading
    # space (``bad_words_token_ids``); a word's last token is banned whenever the output ends with
    # the tokens before it (a one-token word: always). Not with beam search.
    bad_words: list[str] | None = None
    # The output is one of these strings (vLLM's guided_choice / structured_outputs choice): each
    # step may take only a token that continues some choice's tokenization, then EOS once the
    # output spells a whole choice. Each choice is its own tokenization (vLLM's grammar also takes
    # other token splits of the same text). Not with beam search.
    guided_choice: list[str] | None = None
    # Structured outputs (vLLM's guided_json / guided_regex / guided_grammar / json_object, on
    # xgrammar, vLLM's default backend; engine/structured.py): each step may take only a token the
    # grammar accepts, then EOS once the output is complete. A JSON schema (an object, or its JSON
    # text; kept as its JSON text), a regular expression, a grammar (xgrammar's EBNF, or Lark), or
    # any JSON object. At most one guided_* field per request. Not with beam search.
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_json_object: bool = False
    # vLLM's structural_tag (xgrammar's): free text until a trigger, then a tagged section under its
    # own constraint (begin, a JSON schema or another format, end), e.g. tool calls written as
    # "<function=name>{...}</function>". xgrammar's form {"type": "structural_tag", "format": {...}}
    # or the older {"structures": [{"begin", "schema", "end"}], "triggers": [...]}; an object, or its
    # JSON text (kept as its JSON text).
    guided_structural_tag: str | dict[str, Any] | None = None
    # JSON (a schema, json_object) without free whitespace between tokens: one space after ':' and
    # ',' and no newlines, where xgrammar's default lets a model write any run of whitespace there
    # (small models can loop on it until max_tokens). vLLM's disable_any_whitespace.
    disable_any_whitespace: bool = False
    # A reasoning model's thinking block comes before its structured output (vLLM applies the
    # constraint after the reasoning parser's end, as here): the constraint starts after the output's
    # first ``reasoning_end_token_id`` (``</think>``). With ``reasoning_start_token_id`` (``<think>``:
    # Qwen3's style) the block is open only if the first output token opens it, and the first
    # token may do so whatever the constraint; without it (DeepSeek-R1's: the template leaves the
    # prompt inside the block) the output is reasoning from its first token. JSON after a block may
    # open with a little whitespace (``structured.JSON_LEADING_WHITESPACE``). The chat route sets
    # both from the server's reasoning parser.
    reasoning_start_token_id: int | None = None
    reasoning_end_token_id: int | None = None
    # vLLM's: at most this many tokens inside the thinking block (its tags not counted); then the
    # block's end tag is the only token allowed (``thinking_budget.ThinkingBudget``). Needs
    # ``reasoning_end_token_id`` (and ``reasoning_start_token_id`` for Qwen3's style), which the
    # chat route sets from the server's reasoning parser.
    thinking_token_budget: int | None = None
    # Token ids written into the block before its end tag once the budget is spent (llama.cpp's
    # reasoning budget message, Qwen3's "Considering the limited time ..."): a model told why its
    # thinking stops answers better than one cut off mid-thought. At most 64; needs the budget.
    thinking_budget_message_ids: list[int] | None = None
    # vLLM's cache_salt: the request's prompt blocks are shared only with requests of the same salt
    # (a tenant's secret keeps others from timing prefix-cache hits on its prompts).
    cache_salt: str | None = None
    # Which outputs the engine builds for the request (no per-step copy for DELTA / FINAL_ONLY).
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # An embedding request (LLM.embed, /v1/embeddings): its final output carries the last prompt
    # token's final hidden state (RequestOutput.embedding); the one token it samples is no result.
    embed: bool = False

    def __post_init__(self) -> None:
        # --- counts ---
        _check_int("n", self.n, 1, _MAX_INT)
        if self.embed and (self.n != 1 or self.use_beam_search):
            raise InvalidParamError("n", "an embedding request has one output: n must be 1, no beam search")
        _check_int("max_tokens", self.max_tokens, 1, _MAX_INT)
        _check_int("min_tokens", self.min_tokens, 0, _MAX_INT)
        if self.min_tokens > self.max_tokens:
            raise InvalidParamError(
                "min_tokens", f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}."
            )

        # --- floats: accept ints, store floats; every range is finite (float32 arithmetic in the
        # sampler must stay finite: 1e-300 is a positive float64 but 0.0 in float32) ---
        for name, (lo, hi) in _FLOAT_RANGES.items():
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise InvalidParamError(name, f"{name} must be a finite number, got {value!r}.")
            if not lo <= value <= hi:
                raise InvalidParamError(name, f"{name} must be in [{lo:g}, {hi:g}], got {value!r}.")
            setattr(self, name, float(value))
        if self.top_p <= 0.0:
            raise InvalidParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}.")

        if not _is_int(self.top_k) or not -1 <= self.top_k <= _MAX_INT:
            raise InvalidParamError(
                "top_k", f"top_k must be -1 (disable), 0 (disable) or a positive integer, got {self.top_k!r}."
            )
        if self.top_k == -1:
            self.top_k = 0

        if self.seed is not None and (not _is_int(self.seed) or not _MIN_SEED <= self.seed <= _MAX_SEED):
            raise InvalidParamError(
                "seed", f"seed must be an integer in [{_MIN_SEED}, {_MAX_SEED}] or None, got {self.seed!r}."
            )

        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            # -1: the whole vocabulary (vLLM's); the most a request may ask for is the engine's
            # (EngineConfig.max_logprobs), which reads -1 as the vocabulary (bounded_logprobs)
            if value is not None and (not _is_int(value) or value < -1):
                raise InvalidParamError(
                    name, f"{name} must be -1 (the whole vocabulary), an integer >= 0 or None, got {value!r}."
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
            raise InvalidParamError(
                "stop", f"stop must be a string or a list of strings, got {type(stop).__name__}."
            )
        for s in stop:
            if not _is_text(s):
                raise InvalidParamError("stop", f"stop must contain only non-empty strings, got {s!r}.")
        self.stop = stop

        ids = self.stop_token_ids
        if ids is None:
            ids = []
        elif isinstance(ids, (list, tuple)):
            ids = list(ids)
        else:
            raise InvalidParamError(
                "stop_token_ids", f"stop_token_ids must be a list of integers, got {type(ids).__name__}."
            )
        for t in ids:
            if not _is_int(t) or not 0 <= t <= _MAX_INT:
                raise InvalidParamError(
                    "stop_token_ids", f"stop_token_ids must contain only non-negative integers, got {t!r}."
                )
        self.stop_token_ids = ids

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidParamError("logit_bias", "logit_bias must map token ids to numbers.")
            bias: dict[int, float] = {}
            for tok, value in self.logit_bias.items():
                if not _is_int(tok) or not 0 <= tok <= _MAX_INT:
                    raise InvalidParamError("logit_bias", f"logit_bias keys must be token ids, got {tok!r}.")
                if not _is_number(value) or not math.isfinite(value):
                    raise InvalidParamError(
                        "logit_bias", f"logit_bias values must be finite numbers, got {value!r}."
                    )
                bias[tok] = min(max(float(value), -100.0), 100.0)
            self.logit_bias = bias or None

        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            if not isinstance(allowed, (list, tuple)) or not all(
                _is_int(t) and 0 <= t <= _MAX_INT for t in allowed
            ):
                raise InvalidParamError(
                    "allowed_token_ids", "allowed_token_ids must be a list of non-negative token ids."
                )
            if not allowed:
                raise InvalidParamError(
                    "allowed_token_ids", "allowed_token_ids must hold at least one token id."
                )
            self.allowed_token_ids = list(dict.fromkeys(allowed))

        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or not all(_is_text(w) and w.strip() for w in words):
                raise InvalidParamError("bad_words", "bad_words must be a list of words (non-blank strings).")
            self.bad_words = list(dict.fromkeys(words)) or None

        if self.guided_choice is not None:
            choices = self.guided_choice
            if not isinstance(choices, (list, tuple)) or not choices or not all(_is_text(c) for c in choices):
                raise InvalidParamError(
                    "guided_choice", "guided_choice must be a non-empty list of non-empty strings."
                )
            self.guided_choice = list(dict.fromkeys(choices))
        self._check_grammar()
        if self.use_beam_search:  # beam proposals read the raw logits: no mask reaches them
            for name in ("allowed_token_ids", "bad_words", *GUIDED_FIELDS):
                if getattr(self, name):
                    raise InvalidParamError(name, f"{name} is not supported with use_beam_search.")
            if self.thinking_token_budget is not None:
                raise InvalidParamError(
                    "thinking_token_budget", "thinking_token_budget is not supported with use_beam_search."
                )

        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT
        ):
            raise InvalidParamError(
                "cache_salt", f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters."
            )

        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise InvalidParamError(
                    "output_kind",
                    f"output_kind must be 0, 1 or 2 (RequestOutputKind), got {self.output_kind!r}.",
                ) from None
        for name in (
            "ignore_eos", "include_stop_str_in_output", "use_beam_search", "skip_special_tokens", "guided_json_object",
            "disable_any_whitespace",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidParamError(name, f"{name} must be a boolean, got {value!r}.")

    def _check_grammar(self) -> None:
        """The structured-output fields' types; a JSON schema or structural tag kept as its JSON
        text; one at most."""
        for name, what in (("guided_json", "a JSON schema"), ("guided_structural_tag", "a structural tag")):
            schema = getattr(self, name)
            if schema is None:
                continue
            if isinstance(schema, str):
                try:
                    parsed = json.loads(schema)
                except (ValueError, RecursionError) as exc:
                    raise InvalidParamError(name, f"{name} is not valid JSON: {exc}.") from None
            else:
                parsed = schema
            if (depth := _depth(parsed, MAX_SCHEMA_DEPTH)) > MAX_SCHEMA_DEPTH:
                raise InvalidParamError(
                    name, f"{name} nests deeper than {MAX_SCHEMA_DEPTH} levels ({depth} or more)."
                )
            if not isinstance(parsed, dict):
                raise InvalidParamError(name, f"{name} must be {what}: an object, or its JSON text.")
            if not isinstance(schema, str):
                try:
                    setattr(self, name, json.dumps(schema))
                except (TypeError, ValueError) as exc:
                    raise InvalidParamError(name, f"{name} is not JSON: {exc}.") from None
        for name in ("guided_regex", "guided_grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidParamError(name, f"{name} must be a non-empty string.")
        for name in ("reasoning_start_token_id", "reasoning_end_token_id"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= _MAX_INT):
                raise InvalidParamError(name, f"{name} must be a token id (an integer >= 0), got {value!r}.")
        if self.reasoning_start_token_id is not None and self.reasoning_end_token_id is None:
            raise InvalidParamError(
                "reasoning_start_token_id", "reasoning_start_token_id needs reasoning_end_token_id."
            )
        budget = self.thinking_token_budget
        if budget is not None:
            if not _is_int(budget) or not 0 <= budget <= _MAX_INT:
                raise InvalidParamError(
                    "thinking_token_budget", f"thinking_token_budget must be an integer >= 0, got {budget!r}."
                )
            if self.reasoning_end_token_id is None:
                raise InvalidParamError(
                    "thinking_token_budget",
                    "thinking_token_budget needs reasoning_end_token_id (the thinking block's end tag).",
                )
        message = self.thinking_budget_message_ids
        if message is not None:
            if (
                not isinstance(message, (list, tuple))
                or len(message) > MAX_THINKING_MESSAGE
                or not all(_is_int(t) and 0 <= t <= _MAX_INT for t in message)
            ):
                raise InvalidParamError(
                    "thinking_budget_message_ids",
                    f"thinking_budget_message_ids must be a list of at most {MAX_THINKING_MESSAGE} token ids.",
                )
            if budget is None:
                raise InvalidParamError(
                    "thinking_budget_message_ids", "thinking_budget_message_ids needs thinking_token_budget."
                )
            self.thinking_budget_message_ids = list(message)
        if budget is not None and self.allowed_token_ids is not None:
            forced = {self.reasoning_end_token_id, *(message or ())}
            if missing := sorted(forced - set(self.allowed_token_ids)):  # type: ignore[type-var]
                raise InvalidParamError(
                    "allowed_token_ids",
                    "allowed_token_ids must hold the tokens a spent thinking_token_budget forces "
                    f"(reasoning_end_token_id, thinking_budget_message_ids); missing {missing}.",
                )
        given = [n for n in GUIDED_FIELDS if getattr(self, n) not in (None, False)]
        if len(given) > 1:
            raise InvalidParamError(
                given[1], f"{given[1]}: only one of {', '.join(given)} may be set in one request."
            )

    # ------------------------------------------------------------------ helpers

    @property
    def grammar_spec(self) -> tuple[str, str] | None:
        """The structured-output constraint other than a choice, as (field, text), or None."""
        for name in ("guided_json", "guided_regex", "guided_grammar", "guided_structural_tag"):
            value = getattr(self, name)
            if value is not None:
                return name, value
        return ("guided_json_object", "") if self.guided_json_object else None

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
                raise InvalidParamError(None, f"unknown sampling field {key!r}")
        return cls(**{k: v for k, v in d.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: copy.copy(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def clone(self) -> SamplingParams:
        # Lists (stop, stop_token_ids) are copied so the clone can be mutated independently.
        return dataclasses.replace(
            self,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            bad_words=list(self.bad_words) if self.bad_words is not None else None,
            guided_choice=list(self.guided_choice) if self.guided_choice is not None else None,
        )


def logprobs_cap(max_logprobs: int, vocab_size: int) -> int:
    """The most top logprobs a request may ask for: ``EngineConfig.max_logprobs`` (-1: no cap), and
    never more than the vocabulary holds."""
    return vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)


def bounded_logprobs(params: SamplingParams, cap: int, vocab_size: int) -> SamplingParams:
    """``params`` with a ``logprobs`` or ``prompt_logprobs`` of -1 read as ``vocab_size`` (a copy;
    ``params`` itself where neither is -1), or ``LimitExceededError`` naming the field where it
    asks for more than ``cap`` (``logprobs_cap``) top logprobs."""
    wants = {}
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        want = vocab_size if value == -1 else value
        if want is not None and want > cap:
            raise LimitExceededError(
                name,
                f"{name}=-1 asks for the whole vocabulary ({vocab_size}); at most {cap} (max_logprobs)."
                if value == -1
                else f"{name} must be at most {cap} (max_logprobs), got {value}.",
            )
        if value == -1:
            wants[name] = want
    return dataclasses.replace(params, **wants) if wants else params


def _depth(obj: Any, limit: int) -> int:
    """Nesting depth of JSON ``obj`` (a scalar: 0), counted no further than ``limit + 1``."""
    depth, level = 0, [obj]
    while depth <= limit:
        containers = [x for x in level if isinstance(x, (dict, list, tuple))]
        if not containers:
            break
        depth += 1
        level = [c for x in containers for c in (x.values() if isinstance(x, dict) else x)]
    return depth


def bad_words_token_ids(encode: Callable[[str], list[int]], words: Sequence[str]) -> list[list[int]]:
    """vLLM's tokenization of ``bad_words`` (``SamplingParams.update_from_tokenizer``): each word
    as it would start the text, then with a leading space where that is a different first token
    and as many tokens (a word inside the text). ``encode``: text -> ids, no special tokens."""
    out: list[list[int]] = []
    for word in words:
        bare, spaced = list(encode(word.lstrip())), list(encode(" " + word.lstrip()))
        if bare:
            out.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
    return out
