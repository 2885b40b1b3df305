"""Incremental detokenization and stop-string matching.

``IncrementalDetokenizer`` uses vLLM's prefix_offset / read_offset technique: decode a
short window of ids ending at the new token and a window ending just before it, and
emit the difference. Decoding a window (not each token alone) keeps tokenizer-specific
leading-space handling right (SentencePiece's "▁", byte-level BPE's "Ġ"), and holding
back text that ends in U+FFFD keeps a multi-byte character split across tokens from
being emitted half-done.

Works with any tokenizer exposing ``decode(ids, skip_special_tokens=...)``: a
transformers tokenizer or a raw ``tokenizers.Tokenizer``. Fast (Rust) tokenizers take the same
technique through ``tokenizers``' ``DecodeStream``: no Python ``decode`` per token. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# How many prompt tokens give the first output token its left context (vLLM's value).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"
_INVALID_PREFIX = "Invalid prefix encountered"  # DecodeStream's error on a decode that rewrote its prefix


class _Decodes(Protocol):
    def decode(self, ids: Any, *args: Any, **kwargs: Any) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of output token ids into stable text deltas."""

    def __init__(
        self,
        tokenizer: _Decodes,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # transformers tokenizers would otherwise apply their clean-up rules per window.
        self._decode_kwargs: dict[str, Any] = {"skip_special_tokens": skip_special_tokens}
        if _accepts_cleanup_kwarg(tokenizer):
            self._decode_kwargs["clean_up_tokenization_spaces"] = False
        tail = self._context(prompt_token_ids)
        # _ids = prompt tail + output ids; the windows below index into it.
        self._ids: list[int] = tail
        self._num_prompt = len(tail)
        self._prefix_offset = 0  # start of the decode window (context, already emitted)
        self._read_offset = len(tail)  # everything before this has been emitted
        self._text_parts: list[str] = []
        self._text_cache: str | None = ""
        # Fast path: the Rust tokenizer's DecodeStream (the same prefix/read-offset technique, no
        # Python decode per token), seeded with the prompt tail as context. _streamed: ids[:_streamed]
        # have been emitted by it; flush() decodes any rest (an incomplete character) the slow way.
        self._raw = _rust_tokenizer(tokenizer)
        self._stream = (
            DecodeStream(ids=tail, skip_special_tokens=skip_special_tokens) if self._raw is not None else None
        )
        self._streamed = len(tail)

    # ------------------------------------------------------------------ public

    @property
    def token_ids(self) -> list[int]:
        """The output token ids added so far."""
        return self._ids[self._num_prompt :]

    @property
    def text(self) -> str:
        """All output text emitted so far (the concatenation of the deltas)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._text_parts)
        return self._text_cache

    def add(self, token_id: int) -> str:
        """Append one token; return the newly stable text (may be "")."""
        self._ids.append(token_id)
        if self._stream is None:
            return self._step(final=False)
        try:
            delta = self._stream.step(self._raw, token_id)
        except Exception as e:
            # Byte-fallback decoders are not monotonic on invalid UTF-8 (a byte token's text turns
            # into U+FFFD once a later byte joins its run): DecodeStream then raises. Go on the slow way.
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            self._stream = None
            self._read_offset = self._streamed
            self._prefix_offset = max(0, self._streamed - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
            return self._step(final=False)
        if not delta:  # None: an incomplete character, held back
            return ""
        self._streamed = len(self._ids)
        return self._emit(delta)

    def flush(self) -> str:
        """At the end of generation: emit whatever is still held back (even a lone U+FFFD)."""
        if self._stream is None:
            return self._step(final=True)
        if self._streamed == len(self._ids):
            return ""
        # The held-back tail, decoded with a little emitted context (as the windows below do).
        context = self._ids[
            max(0, self._streamed - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET) : self._streamed
        ]
        delta = self._after(context, self._ids[self._streamed :])
        self._streamed = len(self._ids)
        return self._emit(delta) if delta else ""

    def _emit(self, delta: str) -> str:
        self._text_parts.append(delta)
        self._text_cache = None
        return delta

    # ------------------------------------------------------------------ internals

    def _context(self, prompt: Sequence[int]) -> list[int]:
        """The prompt tail that gives the first output token its left context."""
        # A tail of whole characters, as vLLM looks for one: a tail starting inside a character
        # decodes to U+FFFD, and byte-fallback decoders turn the whole byte run into U+FFFD (the
        # trim below would then drop all of it, and Llama's "▁the" would lose its space).
        n = INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
        for size in range(min(n, len(prompt)), min(n + 3, len(prompt)) + 1):  # a character: <= 4 bytes
            tail = list(prompt[len(prompt) - size :])
            if _REPLACEMENT_CHAR not in self._decode(tail):
                return tail
        # A prompt given as ids may end inside a character: its bytes are no context (the output's
        # would complete it, so the text would not be decode(output ids)), and DecodeStream, whose
        # seeded prefix is then "", would emit the prompt tail's text as output.
        tail = list(prompt[-n:])
        while tail and self._decode(tail).endswith(_REPLACEMENT_CHAR):
            tail.pop()
        return tail

    def _after(self, context: list[int], rest: list[int]) -> str:
        """The text ``rest`` adds after ``context`` (already emitted)."""
        text, prefix = self._decode(context + rest), self._decode(context)
        if text.startswith(prefix):
            return text[len(prefix) :]
        # Byte fallback made the context's bytes one invalid run with the rest's (an incomplete
        # character at the end): all U+FFFD, the emitted context's too. The rest alone, then.
        return self._decode(rest)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, **self._decode_kwargs)

    def _step(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        # Nothing new, or a character still incomplete: wait for more tokens.
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        if final and not new_text.startswith(prefix_text):  # byte fallback rewrote the context (_after)
            delta = self._decode(self._ids[self._read_offset :])
        else:
            delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._emit(delta)


def _rust_tokenizer(tokenizer: object) -> Tokenizer | None:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` (itself, or a transformers fast tokenizer's)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    raw = getattr(tokenizer, "_tokenizer", None)
    return raw if isinstance(raw, Tokenizer) else None


def _accepts_cleanup_kwarg(tokenizer: object) -> bool:
    # transformers tokenizers take clean_up_tokenization_spaces; tokenizers.Tokenizer does not.
    try:
        from transformers import PreTrainedTokenizerBase
    except Exception:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(tokenizer, PreTrainedTokenizerBase)


# ---------------------------------------------------------------------- stop strings


def find_stop(text: str, new_chars: int, stops: Sequence[str], include_stop: bool) -> tuple[int, str] | None:
    """Find a stop string that ends within the last ``new_chars`` characters of ``text``.

    Only the region where a stop could newly end is searched (the last ``new_chars +
    len(stop) - 1`` characters), so a stop split across tokens is found once its last
    character arrives. Returns ``(cut, stop)``: the text should be truncated to
    ``text[:cut]`` (cut is after the stop when ``include_stop``), or None. When several
    stops match, the one that starts earliest wins (then the longest).
    """
    if new_chars <= 0 or not stops:
        return None
    n = len(text)
    best: tuple[int, int, str] | None = None  # (start, -len, stop)
    for stop in stops:
        if not stop:
            continue
        start = max(0, n - new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx == -1:
            continue
        key = (idx, -len(stop), stop)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    idx, _, stop = best
    return (idx + len(stop) if include_stop else idx), stop


def hold_back(text: str, stops: Sequence[str], state: list[int] | None = None) -> int:
    """How many trailing characters of ``text`` could be the start of a stop string.

    A streaming caller withholds that many characters so a partial stop string is never
    sent (and later has to be taken back).

    ``state``: one growing text's memo between calls (start with ``[]``; updated in place): each
    stop's answer for the text last time, then that text's length. A stop's answer can grow by
    at most the characters added since, so a call costs the new characters, not each stop's
    length squared (64 stops of 256 characters: ~3 ms a call, per sample per step, without it).
    """
    state = [] if state is None else state
    if len(state) == len(stops) + 1 and state[-1] <= len(text):
        grown = len(text) - state[-1]  # the text only grew since
    else:  # a first call (or another text): from scratch
        state[:], grown = [0] * (len(stops) + 1), len(text)
    for i, stop in enumerate(stops):
        # Longest proper prefix of stop that is a suffix of text (a full stop is find_stop's job).
        top = min(len(stop) - 1, len(text), grown + state[i])
        state[i] = next((k for k in range(top, 0, -1) if text.endswith(stop[:k])), 0)
    state[-1] = len(text)
    return max(state[:-1], default=0)
