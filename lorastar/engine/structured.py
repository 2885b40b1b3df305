"""Structured outputs: a JSON schema, a regular expression, a grammar or any JSON object, as token
masks from xgrammar (vLLM's default structured-output backend). Torch-free at import (the plugin
checks grammars with it); xgrammar, which imports torch, is imported at the first grammar. The
masks reach the logits in ``grammar_mask``.

A request's constraint is compiled once when it is added, off the step loop (a core process on a
worker thread, ``AsyncLLM`` before its add takes the engine's lock; ``GrammarCompiler``; xgrammar caches
compiled grammars, so a repeated schema costs only its parse: SmolLM2's vocabulary, a three-field
schema 4.4-6.7 ms the first time, 0.1-0.2 ms after, the tokenizer's table 0.15 s once per engine;
one ``parse_grammar`` serves the frontend's check and the engine's compile). Each sampling
sequence gets its own matcher (``GrammarRow``), advanced lazily over the sequence's output just
before its next mask is written: a fork (n > 1), a preempted and recomputed sequence or a row
rebuilt later all catch up from the output ids alone, as ``ChoicePaths`` derives its mask from
them.

Invariant: the matcher of a row has accepted exactly the row's output ids up to ``accepted``
that follow its reasoning block, if the request has one (or went off the grammar there, after
which only EOS is allowed, as for a choice). Between steps, that is: a step with drafts
(speculative decoding) fills the mask of each drafted position by stepping the matcher through the
drafts before it, and the engine restores the row's ``checkpoint`` after sampling (xgrammar's
``rollback``), so a draft the model refused never stays in the matcher.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lorastar.engine.sampling import SamplingParams
from lorastar.errors import InvalidParamError

if TYPE_CHECKING:
    from torch import Tensor

# xgrammar's C++ errors start with a log prefix: "[10:08:15] /project/cpp/x.cc:83: " and at times
# "Check failed: (cond) is false: "; the message after it is the part a client can act on.
_LOG_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*(?:Check failed: .*? is false:\s*)?", re.S)


def _clean(exc: BaseException, limit: int = 300) -> str:
    """xgrammar's message, its first line, cut to ``limit`` characters (it may quote the input)."""
    text = _LOG_PREFIX.sub("", str(exc)).strip().split("\n", 1)[0].rstrip(".")
    return (text[:limit] + " ...") if len(text) > limit else (text or type(exc).__name__)


def is_lark(grammar: str) -> bool:
    """vLLM's rule: a grammar with no ``::=`` rule is Lark (``rule: ...``), else EBNF."""
    return not any("::=" in line for line in grammar.splitlines())


JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar keeps compiled grammars without bound by default: every distinct schema a client sends
# would stay in memory. vLLM's default bound (VLLM_XGRAMMAR_CACHE_MB).
GRAMMAR_CACHE_BYTES = 512 << 20
# Its compile threads (8 by default) compete with the step loop's torch threads: half the cores.
COMPILE_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))
_WHAT = {
    "guided_json": "JSON schema",
    "guided_regex": "regular expression",
    "guided_structural_tag": "structural tag",
}
# Templates separate an answer from its thinking block with whitespace (Qwen3's and DeepSeek-R1's
# "</think>\n\n", one token in their vocabularies), and a model that wrote its block expects to
# write it: JSON after a reasoning block may open with up to this many whitespace characters (a
# JSON parser skips them). Bounded, so a small model cannot loop on it; a regular expression or a
# grammar keeps its own start (the whole answer after the block must match it).
JSON_LEADING_WHITESPACE = 4


def _refusal(field: str, exc: BaseException) -> InvalidParamError:
    return InvalidParamError(field, f"{field}: invalid {_WHAT.get(field, 'grammar')}: {_clean(exc)}.")


# String formats xgrammar enforces (vLLM's STRING_SUPPORTED_FORMATS); another one it ignores.
STRING_FORMATS = frozenset(
    {
        "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
        "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip
# Keywords whose value is a map of names to schemas, and those whose value is data, not a schema.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_DATA = frozenset({"enum", "const", "default", "examples"})


def _types(schema: dict[str, Any]) -> set[str]:
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    return {t for t in kinds if isinstance(t, str)}


def _ignored_keyword(schema: dict[str, Any]) -> tuple[str, str] | None:
    """A keyword of this one schema (not its subschemas) that xgrammar compiles without enforcing,
    as ``(what to say, the key that loosens it away)``: vLLM's ``has_xgrammar_unsupported_json_features``,
    less what the installed xgrammar (0.2.8) does enforce (an integer's integral ``multipleOf``,
    ``uniqueItems: false``, ``patternProperties`` and ``propertyNames`` beside ``properties``; each
    checked against its matcher). A ``format`` xgrammar does not know is not refused: JSON Schema
    makes ``format`` an annotation unless a validator opts in (pydantic writes ``"password"``,
    OpenAPI tools ``"int64"``)."""
    types = _types(schema)
    step = schema.get("multipleOf")
    if types & {"integer", "number"} and "multipleOf" in schema:
        integral = isinstance(step, int) or (isinstance(step, float) and step.is_integer())
        if "number" in types or not integral:
            return "'multipleOf'", "multipleOf"
    if "array" in types:
        if schema.get("uniqueItems") is True:
            return "'uniqueItems'", "uniqueItems"
        for key in ("contains", "minContains", "maxContains"):
            if key in schema:
                return f"'{key}'", key
    if "string" in types:
        known_format = isinstance(schema.get("format"), str) and schema["format"] in STRING_FORMATS
        if ("pattern" in schema or known_format) and (bound := _length_bound(schema)):
            return f"'{bound}' with '{'pattern' if 'pattern' in schema else 'format'}'", bound
    if "object" in types and isinstance(names := schema.get("propertyNames"), dict):
        if ("pattern" in names or "format" in names) and (bound := _length_bound(names)):
            what = f"'propertyNames' with '{bound}' and '{'pattern' if 'pattern' in names else 'format'}'"
            return what, "propertyNames"
        if schema.get("unevaluatedProperties", True) is not True:
            return "'unevaluatedProperties' with 'propertyNames'", "unevaluatedProperties"
    return None


def _length_bound(schema: dict[str, Any]) -> str | None:
    return next((k for k in ("minLength", "maxLength") if k in schema), None)


def unenforced_json_feature(schema: Any, where: str = "#") -> str | None:
    """The first keyword of ``schema`` (a JSON schema, parsed) that xgrammar would silently ignore,
    with where it is (a JSON pointer), e.g. ``"'uniqueItems' at #/properties/tags"``; None where
    there is none. vLLM refuses such a schema with its xgrammar backend (as the only backend here,
    a 400) rather than return output that breaks it."""
    if not isinstance(schema, dict):
        return None
    if (keyword := _ignored_keyword(schema)) is not None:
        return f"{keyword[0]} at {where}"
    for key, value in schema.items():
        if key in _DATA:
            continue
        path = f"{where}/{key}"
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            subs = [
                (f"{path}/{str(name).replace('~', '~0').replace('/', '~1')}", sub)
                for name, sub in value.items()
            ]
        elif isinstance(value, list):
            subs = [(f"{path}/{i}", sub) for i, sub in enumerate(value)]
        else:
            subs = [(path, value)]
        for sub_where, sub in subs:
            if (found := unenforced_json_feature(sub, sub_where)) is not None:
                return found
    return None


def strip_unenforced(schema: Any) -> Any:
    """A copy of ``schema`` without the keywords xgrammar would ignore (``unenforced_json_feature``'s),
    so it compiles to the same grammar and is not refused: for the schemas a server builds from a
    request's tools (a forced tool call), which were written to describe a function, not to
    constrain decoding, and which vLLM's default "auto" backend serves through another backend."""
    if isinstance(schema, list):
        return [strip_unenforced(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA else strip_unenforced(v)) for k, v in schema.items()}
    while (keyword := _ignored_keyword(out)) is not None:
        del out[keyword[1]]
    return out


def parse_grammar(params: SamplingParams) -> Any:
    """``params``' constraint as an xgrammar ``Grammar`` (no tokenizer needed), or None where it has
    none; ``InvalidParamError`` naming the field where xgrammar cannot parse it. Also a frontend's
    check, as vLLM's: a bad one is a 400 before it reaches the engine (microseconds for a small
    schema; xgrammar is imported at the first one)."""
    spec = params.grammar_spec
    if spec is None:
        return None
    import xgrammar as xgr

    field, text = spec
    if field == "guided_json" and (found := unenforced_json_feature(json.loads(text))) is not None:
        raise InvalidParamError(  # vLLM's validate_xgrammar_grammar
            field, f"{field}: the JSON schema uses {found}, which the xgrammar backend does not enforce."
        )
    any_whitespace = not params.disable_any_whitespace
    try:
        if field == "guided_regex":
            return xgr.Grammar.from_regex(text)
        if field == "guided_grammar":
            return xgr.Grammar.from_lark(text) if is_lark(text) else xgr.Grammar.from_ebnf(text)
        if field == "guided_structural_tag":
            return structural_tag_grammar(text)
        # a schema, or any JSON object (OpenAI's json_object; vLLM compiles the same schema)
        schema = text if field == "guided_json" else JSON_OBJECT_SCHEMA
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise _refusal(field, exc) from None
    if params.reasoning_end_token_id is None:
        return grammar
    return xgr.Grammar.concat(_leading_whitespace(), grammar)


@functools.cache
def _leading_whitespace() -> Any:
    """Up to ``JSON_LEADING_WHITESPACE`` whitespace characters (built once: every request's JSON
    after a reasoning block starts with it)."""
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(f"root ::= [ \\t\\n\\r]{{0,{JSON_LEADING_WHITESPACE}}}")


def structural_tag_grammar(text: str) -> Any:
    """A structural tag's grammar, as vLLM reads one: the older form (``structures`` of
    ``{"begin", "schema", "end"}`` and ``triggers``) through xgrammar's item list, any other
    through xgrammar's own parser (``{"type": "structural_tag", "format": {...}}``)."""
    import xgrammar as xgr

    tag = json.loads(text)
    if "structures" not in tag:
        return xgr.Grammar.from_structural_tag(text)
    structures, triggers = tag["structures"], tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list):
        raise ValueError("'structures' and 'triggers' must be lists")
    items = []
    for s in structures:
        if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("begin", "end")):
            raise ValueError("each structure needs 'begin' and 'end' strings and a 'schema'")
        schema = s.get("schema", {})
        items.append(xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(schema), end=s["end"]))
    with warnings.catch_warnings():  # xgrammar calls this form deprecated; vLLM still sends it
        warnings.simplefilter("ignore", DeprecationWarning)
        return xgr.Grammar.from_structural_tag(items, triggers)


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
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=COMPILE_THREADS, cache_limit_bytes=GRAMMAR_CACHE_BYTES
                )
            return self._compiler

    def compile(self, params: SamplingParams) -> Any:
        """``params``' constraint as an xgrammar ``CompiledGrammar``, or None where it has none.
        Raises ``InvalidParamError`` naming the field for a schema, expression or grammar that
        xgrammar cannot compile, or that allows no first token (nothing is queued then)."""
        grammar = parse_grammar(params)
        if grammar is None:
            return None
        field = params.grammar_spec[0]
        try:
            compiled = self.compiler().compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise _refusal(field, exc) from None
        if not _can_start(compiled):
            raise InvalidParamError(
                field,
                f"{field}: the {_WHAT.get(field, 'grammar')} accepts no output (it can never complete).",
            )
        return compiled


def _can_start(compiled: Any) -> bool:
    """Whether ``compiled`` allows a first token or an empty output. A grammar whose language is
    empty (``{"$ref": "#"}``, ``root ::= root``, a regex this vocabulary cannot spell) masks every
    token: the sampler then took token 0 and the request ended "stop" with text the constraint
    refuses. One mask, at compile time (tens of microseconds)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    if matcher.is_terminated():
        return True
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


# What ``GrammarRow.fill`` left for the next token.
FREE = 0  # no constraint yet (inside the reasoning block): the row is not masked
MASKED = 1  # the mask is written
ENDED = 2  # only EOS may follow: the grammar has ended, or the output left it


class GrammarRow:
    """One sampling sequence's matcher over its compiled grammar, which applies after the
    sequence's reasoning block when the request names one (``reasoning_end_token_id``)."""

    __slots__ = ("matcher", "accepted", "steps", "off", "eos", "think_start", "think_end", "reasoning")

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
        self.steps = 0  # tokens the matcher accepted since its reset (what ``restore`` rolls back)
        self.off = False  # an output id the grammar refused (a fallback row's token): EOS only
        self.eos = np.asarray(sorted(set(eos_token_ids)), dtype=np.int64)
        self.think_start, self.think_end = think_start, think_end
        # inside the reasoning block: DeepSeek-R1's style opens it before the first token
        self.reasoning = think_end is not None and think_start is None

    def fill(self, output: Sequence[int], bitmask: Tensor, index: int) -> int:
        """Advance over ``output``'s new ids, then, where the grammar applies, write the next
        token's mask into ``bitmask[index]``: ``FREE``, ``MASKED`` or ``ENDED`` (module constants)."""
        self._advance(output)
        n = self.accepted
        m = self.matcher
        if self.reasoning:
            return FREE
        if self.off or m.is_terminated():
            return ENDED
        m.fill_next_token_bitmask(bitmask, index)
        if (n or self.think_start is None) and not bitmask[index].any():
            # a dead end (x ::= x): no token continues. EOS only, as after a refused token (left
            # to the sampler, every logit -inf took token 0 into the text: "!" in Llama 3's vocabulary)
            self.off = True
            return ENDED
        if n == 0 and self.think_start is not None:  # the first token may open the block instead
            word, bit = divmod(self.think_start, 32)
            value = int(bitmask[index, word]) | (1 << bit)
            bitmask[index, word] = value - (1 << 32) if value >= 1 << 31 else value  # as int32
        return MASKED

    def _advance(self, output: Sequence[int]) -> None:
        """Read ``output``'s ids past ``accepted``."""
        n = len(output)
        if n < self.accepted:  # an output never shrinks; a guard, not a path
            self.matcher.reset()
            self.accepted, self.steps, self.off = 0, 0, False
            self.reasoning = self.think_end is not None and self.think_start is None
        for i in range(self.accepted, n):
            if not self._take(int(output[i]), i):
                break
        self.accepted = n

    def _take(self, tok: int, i: int) -> bool:
        """Read ``tok``, the output's id at position ``i``; False where the output leaves the
        grammar there or had left it (``off``: EOS only from then on)."""
        if self.reasoning:
            self.reasoning = tok != self.think_end
        elif i == 0 and tok == self.think_start:
            self.reasoning = True
        elif self.off or self.matcher.is_terminated() or not self.matcher.accept_token(tok):
            self.off = True
            return False
        else:
            self.steps += 1
        return True

    def valid_drafts(self, output: Sequence[int], drafts: Sequence[int]) -> int:
        """How many leading ``drafts`` may follow ``output`` (vLLM's ``validate_tokens``: a draft
        past the first one the grammar refuses is never run, it could not be kept). The row reads
        ``output`` for good and ends as it was after it."""
        self._advance(output)
        state = self.checkpoint()
        k = 0
        for tok in drafts:
            if not self._take(tok, self.accepted + k):
                break
            k += 1
        self.restore(state)
        return k

    def checkpoint(self) -> tuple[int, int, bool, bool]:
        """The row's state, for ``restore``: speculative decoding fills the masks of drafted
        positions by stepping the matcher through the drafts, then takes them back."""
        return self.accepted, self.steps, self.off, self.reasoning

    def restore(self, state: tuple[int, int, bool, bool]) -> None:
        """Back to ``state`` (a ``checkpoint`` of this row taken since its last reset): the matcher
        rolls back the tokens it accepted since (xgrammar's rollback is unbounded), and the next
        ``fill`` catches up over the output as it then is."""
        accepted, steps, self.off, self.reasoning = state
        if self.steps > steps:
            self.matcher.rollback(self.steps - steps)
        self.accepted, self.steps = accepted, steps
