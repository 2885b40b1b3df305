"""Structured outputs: a JSON schema, a regular expression, a grammar or any JSON object, as token
masks from xgrammar (vLLM's default structured-output backend).

A request's constraint is compiled once when it is added (``GrammarCompiler``; xgrammar caches
compiled grammars, so a repeated schema costs nothing: SmolLM2's vocabulary, a three-field schema
4.4 ms the first time, 26 us after, the tokenizer's table 0.15 s once per engine). Each sampling
sequence gets its own matcher (``GrammarRow``), advanced lazily over the sequence's output just
before its next mask is written: a fork (n > 1), a preempted and recomputed sequence or a row
rebuilt later all catch up from the output ids alone, as ``ChoicePaths`` derives its mask from
them.

Invariant: the matcher of a row has accepted exactly the row's output ids up to ``accepted``
that follow its reasoning block, if the request has one (or went off the grammar there, after
which only EOS is allowed, as for a choice).
"""

from __future__ import annotations

import functools
import re
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from lorastar.engine.sampling import SamplingParams
from lorastar.errors import InvalidParamError

# xgrammar's C++ errors start with a log prefix: "[10:08:15] /project/cpp/x.cc:83: " and at times
# "Check failed: (cond) is false: "; the message after it is the part a client can act on.
_LOG_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*(?:Check failed: .*? is false:\s*)?", re.S)


def _clean(exc: BaseException) -> str:
    text = _LOG_PREFIX.sub("", str(exc)).strip()
    return text.split("\n", 1)[0].rstrip(".") or type(exc).__name__


def is_lark(grammar: str) -> bool:
    """vLLM's rule: a grammar with no ``::=`` rule is Lark (``rule: ...``), else EBNF."""
    return not any("::=" in line for line in grammar.splitlines())


JSON_OBJECT_SCHEMA = '{"type": "object"}'
_WHAT = {"guided_json": "JSON schema", "guided_regex": "regular expression"}


def _refusal(field: str, exc: BaseException) -> InvalidParamError:
    return InvalidParamError(field, f"{field}: invalid {_WHAT.get(field, 'grammar')}: {_clean(exc)}.")


def validate_grammar(params: SamplingParams) -> None:
    """Parse ``params``' JSON schema, regex or grammar without a tokenizer (a frontend's check,
    as vLLM's, so a bad one is a 400 naming the field before it reaches the engine; microseconds
    for a small schema, xgrammar imported at the first one). ``InvalidParamError`` where it fails."""
    spec = params.grammar_spec
    if spec is None or spec[0] == "guided_json_object":
        return  # its schema is fixed
    import xgrammar as xgr

    field, text = spec
    try:
        if field == "guided_json":
            xgr.Grammar.from_json_schema(text, any_whitespace=not params.disable_any_whitespace)
        elif field == "guided_regex":
            xgr.Grammar.from_regex(text)
        elif is_lark(text):
            xgr.Grammar.from_lark(text)
        else:
            xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise _refusal(field, exc) from None


class GrammarCompiler:
    """Compiles requests' constraints for one model's tokenizer and vocabulary (logits width).
    The tokenizer's table is built at the first constraint (an engine never asked for one never
    loads xgrammar's tables, or the tokenizer, for it)."""

    def __init__(self, tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()  # a core process compiles on a worker thread

    def compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer(), vocab_size=self.vocab_size, stop_token_ids=list(self.eos_token_ids)
                )
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler

    def compile(self, params: SamplingParams) -> Any:
        """``params``' constraint as an xgrammar ``CompiledGrammar``, or None where it has none.
        Raises ``InvalidParamError`` naming the field for a schema, expression or grammar that
        xgrammar cannot compile (nothing is queued then)."""
        spec = params.grammar_spec
        if spec is None:
            return None
        field, text = spec
        compiler = self.compiler()
        any_whitespace = not params.disable_any_whitespace
        try:
            if field == "guided_json":
                return compiler.compile_json_schema(text, any_whitespace=any_whitespace)
            if field == "guided_regex":
                return compiler.compile_regex(text)
            if field == "guided_grammar":
                return compiler.compile_lark(text) if is_lark(text) else compiler.compile_grammar(text)
            # any JSON object (OpenAI's json_object; vLLM compiles the same schema)
            return compiler.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=any_whitespace)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise _refusal(field, exc) from None


# What ``GrammarRow.fill`` left for the next token.
FREE = 0  # no constraint yet (inside the reasoning block): the row is not masked
MASKED = 1  # the mask is written
ENDED = 2  # only EOS may follow: the grammar has ended, or the output left it


class GrammarRow:
    """One sampling sequence's matcher over its compiled grammar, which applies after the
    sequence's reasoning block when the request names one (``reasoning_end_token_id``)."""

    __slots__ = ("matcher", "accepted", "off", "eos", "think_start", "think_end", "reasoning")

    def __init__(
        self,
        compiled: Any,
        eos_token_ids: Sequence[int],
        think_start: int | None = None,
        think_end: int | None = None,
    ) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.accepted = 0  # output ids seen (the matcher's, and the reasoning block's)
        self.off = False  # an output id the grammar refused (a fallback row's token): EOS only
        self.eos = np.asarray(sorted(set(eos_token_ids)), dtype=np.int64)
        self.think_start, self.think_end = think_start, think_end
        # inside the reasoning block: DeepSeek-R1's style opens it before the first token
        self.reasoning = think_end is not None and think_start is None

    def fill(self, output: Sequence[int], bitmask: Tensor, index: int) -> int:
        """Advance over ``output``'s new ids, then, where the grammar applies, write the next
        token's mask into ``bitmask[index]``: ``FREE``, ``MASKED`` or ``ENDED`` (module constants)."""
        n = len(output)
        if n < self.accepted:  # an output never shrinks; a guard, not a path
            self.matcher.reset()
            self.accepted, self.off = 0, False
            self.reasoning = self.think_end is not None and self.think_start is None
        m = self.matcher
        for i in range(self.accepted, n):
            tok = int(output[i])
            if self.reasoning:
                self.reasoning = tok != self.think_end
            elif i == 0 and tok == self.think_start:
                self.reasoning = True
            elif self.off or m.is_terminated() or not m.accept_token(tok):
                self.off = True
                break
        self.accepted = n
        if self.reasoning:
            return FREE
        if self.off or m.is_terminated():
            return ENDED
        m.fill_next_token_bitmask(bitmask, index)
        if n == 0 and self.think_start is not None:  # the first token may open the block instead
            word, bit = divmod(self.think_start, 32)
            value = int(bitmask[index, word]) | (1 << bit)
            bitmask[index, word] = value - (1 << 32) if value >= 1 << 31 else value  # as int32
        return MASKED


_BIT = torch.arange(32, dtype=torch.int32)


def bitmask_to_bool(bitmask: Tensor, vocab: int) -> Tensor:
    """xgrammar's packed mask ``[R, ceil(V / 32)] int32`` (bit j of word k: token 32k + j may be
    sampled) as ``[R, vocab]`` bool, on ``bitmask``'s device (the plain form of
    ``bitmask_to_additive``).

    Semantics: out[r, t] = (bitmask[r, t // 32] >> (t % 32)) & 1"""
    bits = (bitmask.unsqueeze(-1) >> _BIT.to(bitmask.device)) & 1  # [R, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


@functools.lru_cache(maxsize=8)
def _byte_masks(device: torch.device) -> Tensor:
    """[256, 8] float32: row b, column j is 0 where bit j of byte b is set, else -inf."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.where(bits.bool(), 0.0, float("-inf")).to(device)


def bitmask_to_additive(bitmask: Tensor, vocab: int) -> Tensor:
    """xgrammar's packed mask as ``[R, vocab]`` float32 to add to logits: 0 where the token may be
    sampled, -inf elsewhere; one byte-table lookup (an embedding) per 8 tokens. On this VM's CPU,
    2 threads, SmolLM2's vocabulary: 0.74 / 2.7 ms at 16 / 64 rows for the lookup and the add, where
    unpacking the bits with shifts and ``masked_fill`` took 3.4 / 13 ms and xgrammar's own CPU
    ``apply_token_bitmask_inplace`` 2.4 / 10 ms (bool tensors are slow here).

    Semantics: out[r, t] = 0 if (bitmask[r, t // 32] >> (t % 32)) & 1 else -inf"""
    if sys.byteorder != "little":  # the bytes of a word in token order: little-endian only
        return torch.zeros(()).masked_fill(~bitmask_to_bool(bitmask, vocab), float("-inf"))
    b = bitmask.contiguous().view(torch.uint8).to(torch.int32)  # [R, 4W]: byte k holds tokens 8k..8k+7
    return F.embedding(b, _byte_masks(bitmask.device)).reshape(bitmask.shape[0], -1)[:, :vocab]


def apply_grammars(x: Tensor, rows: Sequence[Any], idx: list[int]) -> list[int]:
    """Rows ``idx`` of ``x [R, V]`` (their ``grammar`` set) keep only the tokens their grammar
    allows next (-inf elsewhere). Returns the rows that may take only EOS (the caller masks them
    as it does a choice's off-path rows)."""
    if not idx:
        return []
    vocab = x.shape[1]
    bitmask = torch.full((len(idx), -(-vocab // 32)), -1, dtype=torch.int32)  # [G, W], all allowed
    masked: list[int] = []
    eos_only: list[int] = []
    for j, i in enumerate(idx):
        row = rows[i]
        state = row.grammar.fill(row.output_token_ids, bitmask, j)
        if state == MASKED:
            masked.append(j)
        elif state == ENDED:
            eos_only.append(i)
    if masked:
        keep = masked if len(masked) < len(idx) else slice(None)
        add = bitmask_to_additive(bitmask[keep].to(x.device, non_blocking=True), vocab)  # [M, V]
        inf = float("inf")
        if len(masked) == x.shape[0]:  # every row is masked (then idx is 0..R-1)
            x.add_(add).nan_to_num_(nan=-inf, posinf=inf, neginf=-inf)  # +inf + -inf: masked
        else:
            r = torch.tensor([idx[j] for j in masked], device=x.device)
            x[r] = (x[r] + add).nan_to_num_(nan=-inf, posinf=inf, neginf=-inf)
    return eos_only
