"""Batched token sampling with per-request parameters and seeded generators.

One call samples one token for each row of a ``[R, V]`` logits tensor. Order (vLLM's):
guided_choice / grammar masks -> logprobs -> allowed_token_ids and bad_words masks -> min_tokens
mask -> logit_bias -> penalties -> greedy rows: argmax; other rows: temperature, min-p, top-k,
top-p, then an inverse-CDF draw. A seeded row draws exactly one uniform from its own generator
per step, and every op is row-wise, so its token does not depend on what else is in the batch.

Logprobs are taken from ``log_softmax`` of the raw logits (before penalties and
temperature), as vLLM v1 does by default; a structured-output row's are those of its grammar's
distribution (vLLM applies the grammar bitmask to the logits before its sampler).

Invariant, whatever the logits (NaN, +-inf, all masked) and parameters: every sampled id is in
``[0, V)`` and every logprob is finite, so no row can poison the next step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from torch import Tensor

from lorastar.engine.grammar_mask import apply_grammars
from lorastar.engine.sampling import SamplingParams
from lorastar.engine.structured import GrammarRow
from lorastar.engine.thinking_budget import ThinkingBudget
from lorastar.forward_context import to_device

# A row's logprobs: {token_id: (logprob, rank)}, rank 1-based (vLLM's Logprob.rank).
# Logprobs are clamped to this (vLLM's API clamps -inf the same way), so they are always finite.
MIN_LOGPROB = -9999.0
_NEG_INF = float("-inf")
RowLogprobs = dict[int, tuple[float, int]]


@dataclass(slots=True, frozen=True)
class BadWords:
    """A request's ``bad_words`` as the sampler applies them (vLLM's semantics: the output so far,
    not the prompt, must end with the tokens before a word's last one for that one to be banned).
    Built once per request; a step looks up only the words whose next-to-last token is the row's
    last output token, so its cost does not grow with the number of words."""

    single: np.ndarray  # [k] int64: one-token words, banned at every step
    # next-to-last token -> [(the tokens before it, the word's last token)]
    multi: dict[int, list[tuple[tuple[int, ...], int]]]

    @classmethod
    def from_token_ids(cls, words: Sequence[Sequence[int]]) -> BadWords | None:
        single = sorted({w[0] for w in words if len(w) == 1})
        multi: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        for w in words:
            if len(w) > 1:
                multi.setdefault(w[-2], []).append((tuple(w[:-2]), w[-1]))
        if not single and not multi:
            return None
        return cls(np.asarray(single, dtype=np.int64), multi)

    def banned(self, output: Sequence[int]) -> list[int]:
        """The multi-token words' last tokens banned after ``output``."""
        n = len(output)
        if not n or not self.multi:
            return []
        out: list[int] = []
        for rest, last in self.multi.get(output[-1], ()):
            k = len(rest)
            if not k or (n > k and tuple(output[n - 1 - k : n - 1]) == rest):
                out.append(last)
        return out


@dataclass(slots=True, frozen=True)
class ChoicePaths:
    """A request's ``guided_choice`` as token paths: after an output ``o``, ``next[tuple(o)]`` holds
    the tokens that continue some choice (and the EOS ids where ``o`` spells a whole choice). An
    output on no path (EOS sampled under ignore_eos, a masked-out row's fallback) may take EOS only."""

    next: dict[tuple[int, ...], np.ndarray]
    eos: np.ndarray  # [k] int64
    longest: int  # tokens of the longest choice: a longer output is on no path

    @classmethod
    def from_token_ids(cls, choices: Sequence[Sequence[int]], eos: Sequence[int]) -> ChoicePaths:
        nxt: dict[tuple[int, ...], set[int]] = {}
        for ids in choices:
            for i, t in enumerate(ids):
                nxt.setdefault(tuple(ids[:i]), set()).add(t)
            nxt.setdefault(tuple(ids), set()).update(eos)
        arrays = {k: np.asarray(sorted(v), dtype=np.int64) for k, v in nxt.items()}
        longest = max((len(c) for c in choices), default=0)
        return cls(arrays, np.asarray(sorted(set(eos)), dtype=np.int64), longest)

    def allowed(self, output: Sequence[int]) -> np.ndarray:
        if len(output) > self.longest:
            return self.eos
        got = self.next.get(tuple(output))
        return self.eos if got is None else got


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one sequence for this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Owned by the request (seeded from params.seed); None -> the sampler's default generator.
    generator: torch.Generator | None = None
    # Extra EOS ids for min_tokens masking (merged with the sampler's own eos ids).
    eos_token_ids: tuple[int, ...] = ()
    # The prompt's distinct in-vocabulary ids (int64), built by the sampler the first time a
    # repetition penalty needs them: the prompt never changes, and re-reading a long one every
    # step cost more than the rest of sampling (see ``_apply_penalties``).
    prompt_ids: np.ndarray | None = None
    # The request's bad_words as token ids (the engine tokenizes them once); None: none.
    bad_words: BadWords | None = None
    # The request's guided_choice as token paths (the engine tokenizes them once); None: none.
    choices: ChoicePaths | None = None
    # This sequence's matcher of the request's compiled JSON schema / regex / grammar (its own:
    # structured.GrammarRow); None: none.
    grammar: GrammarRow | None = None
    # This sequence's thinking block under the request's thinking_token_budget; None: no budget.
    thinking: ThinkingBudget | None = None


@dataclass(slots=True)
class PendingTokens:
    """Sampling rows whose last output id is a placeholder (async scheduling): the token the
    previous step sampled for it is still on the device, ``ids[src[j]]`` for row ``rows[j]``.
    Penalties count it from there, so a step needs no read-back of the one before."""

    ids: Tensor  # [R_prev] the previous step's sampled ids, on the device
    rows: list[int]  # rows of this step (ascending)
    src: list[int]  # their rows in ``ids``


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[RowLogprobs | None]  # one per row; None where params.logprobs is None


class PendingSample:
    """A launched sample: the ``[R]`` token ids on the device, read back by ``result()`` (with the
    logprobs of the rows that asked). ``copy_out``: the ids, and the logprobs' reductions (the
    sampled token's logprob and rank, the top k), are queued at launch and start on their way to
    pinned host memory behind an event, so ``result()`` waits for this step's sampling only and not
    for work queued after it (the next step's forward, under async scheduling)."""

    __slots__ = ("_event", "_host", "_ks", "_lp_idx", "_raw_logprobs", "token_ids")

    def __init__(
        self,
        token_ids: Tensor,
        raw_logprobs: Tensor | None,
        ks: np.ndarray,
        lp_idx: list[int],
        *,
        copy_out: bool = False,
    ) -> None:
        self.token_ids = token_ids  # [R] int64, on the logits' device
        self._raw_logprobs = raw_logprobs
        self._ks = ks
        self._lp_idx = lp_idx
        # Copies read by result(): the ids, then (logprobs asked) logprob, rank, top ids, top values.
        self._host: list[Tensor] = []
        self._event: torch.cuda.Event | None = None
        if copy_out:  # CUDA: pinned, behind an event (elsewhere plain copies: the same path, testable)
            parts = [token_ids]
            if raw_logprobs is not None:  # the logprobs' reductions queued now too, read back with the ids
                tok = _rows(token_ids, lp_idx)
                tok_lp, ranks, top = _logprob_tensors(raw_logprobs, tok, int(ks[lp_idx].max()))
                parts += [tok_lp, ranks, *(top or ())]
            for t in parts:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
                host.copy_(t, non_blocking=t.is_cuda)
                self._host.append(host)
            if token_ids.is_cuda:
                self._event = torch.cuda.Event()
                self._event.record()

    @torch.inference_mode()
    def result(self) -> SamplerOutput:
        if self._host:
            if self._event is not None:
                self._event.synchronize()
            token_list: list[int] = self._host[0].tolist()
            lps: list[RowLogprobs | None] = [None] * len(token_list)
            if len(self._host) > 1:
                tok_l = [token_list[i] for i in self._lp_idx]
                tok_lp_l, ranks_l = (h.tolist() for h in self._host[1:3])
                tops = [h.tolist() for h in self._host[3:5]] or [[[] for _ in tok_l]] * 2
                k_l: list[int] = self._ks[self._lp_idx].tolist()
                lps = _logprob_dicts(len(token_list), self._lp_idx, k_l, tok_l, tok_lp_l, ranks_l, *tops)
            return SamplerOutput(token_ids=token_list, logprobs=lps)
        token_list = self.token_ids.tolist()
        lps = [None] * len(token_list)
        if self._raw_logprobs is not None:
            lps = Sampler._gather_logprobs(self._raw_logprobs, self.token_ids, self._ks, self._lp_idx)
        return SamplerOutput(token_ids=token_list, logprobs=lps)


# The sampling parameters the sampler reads as arrays: (name, how to read it off SamplingParams,
# dtype). Floats stay float64 so every on/off test (``top_p < 1``, ``repetition != 1``) is the
# Python float's; tensors made from them are float32 as before.
_COLUMNS: tuple[tuple[str, Callable[[SamplingParams], object], type], ...] = (
    ("greedy", lambda p: p.is_greedy, np.bool_),
    ("temperature", lambda p: p.temperature, np.float64),
    ("top_k", lambda p: p.top_k, np.int64),
    ("top_p", lambda p: p.top_p, np.float64),
    ("min_p", lambda p: p.min_p, np.float64),
    ("repetition", lambda p: p.repetition_penalty, np.float64),
    ("frequency", lambda p: p.frequency_penalty, np.float64),
    ("presence", lambda p: p.presence_penalty, np.float64),
    ("min_tokens", lambda p: p.min_tokens, np.int64),
    ("logprobs", lambda p: -1 if p.logprobs is None else p.logprobs, np.int64),
    ("logit_bias", lambda p: bool(p.logit_bias), np.bool_),
    ("allowed", lambda p: p.allowed_token_ids is not None, np.bool_),
    ("bad_words", lambda p: bool(p.bad_words), np.bool_),
    ("guided", lambda p: p.guided_choice is not None or p.grammar_spec is not None, np.bool_),
    ("thinking", lambda p: p.thinking_token_budget is not None, np.bool_),
)


@dataclass(slots=True, eq=False)
class SamplingMetadata:
    """A step's sampling parameters as arrays, one entry per sampling row (vLLM v1's
    ``SamplingMetadata``): the sampler's masks and per-row values come from these instead of a
    pass over every row's ``SamplingParams``. The engine takes them from ``SamplingTable`` rows
    that persist across steps; ``from_params`` builds them for a list of parameters."""

    greedy: np.ndarray  # [R] bool: SamplingParams.is_greedy
    temperature: np.ndarray  # [R] float64
    top_k: np.ndarray  # [R] int64: 0 off
    top_p: np.ndarray  # [R] float64: 1.0 off
    min_p: np.ndarray  # [R] float64: 0.0 off
    repetition: np.ndarray  # [R] float64: 1.0 off
    frequency: np.ndarray  # [R] float64
    presence: np.ndarray  # [R] float64
    min_tokens: np.ndarray  # [R] int64
    logprobs: np.ndarray  # [R] int64: -1 not asked
    logit_bias: np.ndarray  # [R] bool: the row has a logit_bias (its dict is on its params)
    allowed: np.ndarray  # [R] bool: the row has allowed_token_ids (on its params)
    bad_words: np.ndarray  # [R] bool: the row has bad_words (token ids on its SamplingRow)
    guided: np.ndarray  # [R] bool: the row has guided_choice or a grammar (on its SamplingRow)
    thinking: np.ndarray  # [R] bool: the row has a thinking_token_budget (on its SamplingRow)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams]) -> SamplingMetadata:
        return cls(*(np.array([read(p) for p in params], dtype=dt) for _, read, dt in _COLUMNS))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SamplingMetadata) and all(
            np.array_equal(getattr(self, name), getattr(other, name)) for name, _, _ in _COLUMNS
        )

    def take(self, idx: np.ndarray) -> SamplingMetadata:
        """The rows ``idx`` (an int array), in that order."""
        return SamplingMetadata(*(getattr(self, name)[idx] for name, _, _ in _COLUMNS))


class SamplingTable:
    """Sampling parameters of the input batch's rows, written once when a sequence gets its row
    (a request's parameters never change): a step's ``SamplingMetadata`` is one gather of rows."""

    def __init__(self, rows: int) -> None:
        self.rows = SamplingMetadata(*(np.zeros(rows, dtype=dt) for _, _, dt in _COLUMNS))

    def grow(self, rows: int) -> None:
        def grown(c: np.ndarray) -> np.ndarray:
            return np.concatenate([c, np.zeros(rows - len(c), dtype=c.dtype)])

        self.rows = SamplingMetadata(*(grown(getattr(self.rows, name)) for name, _, _ in _COLUMNS))

    def set(self, row: int, params: SamplingParams) -> None:
        for name, read, _ in _COLUMNS:
            getattr(self.rows, name)[row] = read(params)

    def take(self, rows: Sequence[int]) -> SamplingMetadata:
        return self.rows.take(np.asarray(rows, dtype=np.int64))


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A request's private generator (the engine creates one per seeded sequence)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


class Sampler:
    def __init__(
        self,
        seed: int = 0,
        device: str | torch.device = "cpu",
        eos_token_id: int | Sequence[int] | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.generator = make_generator(seed, self.device)
        if eos_token_id is None:
            self.eos_token_ids: tuple[int, ...] = ()
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = (eos_token_id,)
        else:
            self.eos_token_ids = tuple(eos_token_id)

    # ------------------------------------------------------------------ main entry

    def __call__(
        self, logits: Tensor, rows: Sequence[SamplingRow], meta: SamplingMetadata | None = None
    ) -> SamplerOutput:
        """One token per row of ``logits [R, V]``. ``meta``: the rows' parameters as arrays (the
        engine's, from its persistent batch); built from ``rows`` when not given."""
        return self.launch(logits, rows, meta).result()

    @torch.inference_mode()
    def launch(
        self,
        logits: Tensor,
        rows: Sequence[SamplingRow],
        meta: SamplingMetadata | None = None,
        *,
        no_sync: bool = False,
        pending: PendingTokens | None = None,
    ) -> PendingSample:
        """``__call__`` without reading the tokens back: their ``[R]`` tensor stays on the device
        (the next step's input ids can be taken from it) until ``result()``. ``no_sync``: on a GPU,
        queue no operation that waits for the device (async scheduling): the NaN fallbacks run
        unconditionally instead of behind a check, and the ids are copied to pinned host memory
        behind an event. ``pending``: rows whose last output id is not known on the host yet
        (penalties read it on the device; the rest of sampling reads only how many there are)."""
        num_rows, vocab = logits.shape  # [R, V]
        if num_rows != len(rows):
            raise ValueError(f"logits has {num_rows} rows but {len(rows)} sampling rows were given")
        if num_rows == 0:
            return PendingSample(torch.empty(0, dtype=torch.long), None, np.zeros(0, np.int64), [])
        if meta is None:
            meta = SamplingMetadata.from_params([r.params for r in rows])
        elif len(meta.greedy) != num_rows:
            raise ValueError(f"sampling metadata has {len(meta.greedy)} rows but logits has {num_rows}")
        dev = logits.device
        min_tok_rows = _below_min_tokens(rows, meta)
        end_rows = _thinking_spent(rows, meta)
        # Work in fp32 (low-precision softmax loses the tail); copy only if masks/penalties
        # will write into it, so the caller's logits are never modified.
        writes = bool(
            min_tok_rows
            or end_rows
            or meta.logit_bias.any()
            or meta.allowed.any()
            or meta.bad_words.any()
            or meta.guided.any()
            or (meta.repetition != 1.0).any()
            or (meta.frequency != 0.0).any()
            or (meta.presence != 0.0).any()
        )
        x = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=writes)  # [R, V]

        # Rows whose masks together may leave no token (every logit -inf: the argmax took token 0,
        # which is "!" in Llama 3's vocabulary): their fallback, applied where that happens.
        guard = _may_empty(meta, min_tok_rows)
        g = to_device(guard, dev) if guard else None
        unmasked = x[g] if g is not None else None  # [G, V]: a copy, before any mask (the fallback's)
        # vLLM applies the grammar bitmask to the logits before its sampler: the logprobs are those of
        # the grammar's (or choice's) distribution, its banned tokens -inf (MIN_LOGPROB here).
        _apply_choices(x, rows, vocab, np.flatnonzero(meta.guided).tolist())

        lp_idx: list[int] = np.flatnonzero(meta.logprobs >= 0).tolist()
        raw_logprobs = None
        if (
            lp_idx
        ):  # [Rl, V]: the rows that asked; finite whatever the logits (an all -inf row has NaN softmax)
            lp_rows = x if len(lp_idx) == num_rows else x[to_device(lp_idx, dev)]
            raw_logprobs = (
                torch.log_softmax(lp_rows, dim=-1).nan_to_num_(nan=MIN_LOGPROB).clamp_(min=MIN_LOGPROB)
            )

        _apply_allowed(x, rows, vocab, np.flatnonzero(meta.allowed).tolist())
        fallback = (
            _fallback_rows(unmasked, rows, guard, vocab, self.eos_token_ids) if unmasked is not None else None
        )  # [G, V]
        _apply_bad_words(x, rows, vocab, np.flatnonzero(meta.bad_words).tolist())
        self._apply_min_tokens(x, rows, vocab, min_tok_rows)
        if g is not None and fallback is not None:
            left = x[g]  # [G, V]
            emptied = left.amax(dim=-1, keepdim=True) == _NEG_INF  # [G, 1], on the device: no wait
            x[g] = torch.where(emptied, fallback, left)
        _apply_logit_bias(x, rows, vocab, np.flatnonzero(meta.logit_bias).tolist())
        self._apply_penalties(x, rows, vocab, meta, pending)
        _force_tokens(x, end_rows)  # a spent thinking budget's message, then its end tag

        may_sync = not (no_sync and dev.type == "cuda")
        token_ids = torch.empty(num_rows, dtype=torch.long, device=dev)  # [R]
        if meta.greedy.all():
            token_ids = _argmax(x, may_sync)
        elif not meta.greedy.any():
            token_ids = self._sample(x, rows, meta, may_sync)
        else:
            greedy_idx, random_idx = np.flatnonzero(meta.greedy), np.flatnonzero(~meta.greedy)
            gi = to_device(greedy_idx, dev)
            token_ids[gi] = _argmax(x[gi], may_sync)
            ri = to_device(random_idx, dev)
            token_ids[ri] = self._sample(
                x[ri], [rows[i] for i in random_idx.tolist()], meta.take(random_idx), may_sync
            )
        token_ids.clamp_(0, vocab - 1)  # argmax and the draw already are; a cheap guarantee
        return PendingSample(token_ids, raw_logprobs, meta.logprobs, lp_idx, copy_out=not may_sync)

    # ------------------------------------------------------------------ masks and penalties

    def _apply_min_tokens(
        self, x: Tensor, rows: Sequence[SamplingRow], vocab: int, active: list[int]
    ) -> None:
        # Until min_tokens are generated, EOS and stop_token_ids cannot be sampled: vLLM's
        # ``all_stop_token_ids``, which holds EOS even under ignore_eos (ignore_eos only keeps EOS
        # from ending the request once it may be sampled).
        r_idx: list[int] = []
        t_idx: list[int] = []
        for i in active:
            r = rows[i]
            banned = set(r.params.stop_token_ids or ())
            banned.update(self.eos_token_ids)
            banned.update(r.eos_token_ids)
            for t in banned:
                if 0 <= t < vocab:
                    r_idx.append(i)
                    t_idx.append(t)
        if r_idx:
            _fill(x, (to_device(r_idx, x.device), to_device(t_idx, x.device)), _NEG_INF)

    def _apply_penalties(
        self,
        x: Tensor,
        rows: Sequence[SamplingRow],
        vocab: int,
        meta: SamplingMetadata | None = None,
        pending: PendingTokens | None = None,
    ) -> None:
        """vLLM semantics: repetition over prompt+output (divide positive logits, multiply
        negative ones), then frequency (x count) and presence (x [count > 0]) over output only.

        Sparse: only the (row, token) pairs that occur are read and written (a few hundred per
        row against a 49k vocabulary). The dense form (counts and masks over [R, V]) took 29 ms
        for 64 rows on one thread here; the values are the same, op for op. Repetition pairs may
        repeat (a token in prompt and output, or twice in the output): every copy is read before
        any is written and all copies write the same value, so no dedup is needed; with each
        row's prompt ids kept on the row, a step reads only the outputs. 64 rows with a 2,000-token
        prompt and 200 outputs, repetition 1.1, one thread: the sampler 35.9 -> 7.3 ms a step (a fresh read
        and ``np.unique`` of prompt + output every step before).

        ``pending`` rows' last output id is a placeholder: the host pairs leave it out and its
        device value joins as one more pair (P of them), with the count it makes: the values
        written are the ones a known token would give, op for op."""
        if meta is None:
            meta = SamplingMetadata.from_params([r.params for r in rows])
        dev = x.device
        rep_rows: list[int] = np.flatnonzero(meta.repetition != 1.0).tolist()
        need = (meta.frequency != 0.0) | (meta.presence != 0.0)
        if not rep_rows and not need.any():
            return
        trim = np.zeros(len(rows), dtype=np.bool_)  # [R] rows whose last output id is a placeholder
        has_pending = pending is not None and bool(pending.rows)
        if has_pending:
            trim[pending.rows] = True
            pend_rows = np.asarray(pending.rows, dtype=np.int64)  # [P]
            pend_tok = pending.ids[to_device(pending.src, dev)]  # [P] on the device
        if rep_rows:
            r_idx, t_idx = _occurrences(rows, rep_rows, vocab, trim)
            sel = np.flatnonzero(meta.repetition[pend_rows] != 1.0) if has_pending else []
            if r_idx.size or len(sel):
                flat = to_device(r_idx * vocab + t_idx, dev)  # [N] into x.view(-1)
                rp = to_device(meta.repetition.astype(np.float32)[r_idx], dev)  # [N]
                if len(sel):  # a token in both lists is written twice with the same value
                    pr = pend_rows[sel]
                    flat = torch.cat([flat, to_device(pr * vocab, dev) + pend_tok[to_device(sel, dev)]])
                    rp = torch.cat([rp, to_device(meta.repetition.astype(np.float32)[pr], dev)])
                x_flat = x.view(-1)  # the caller's x is contiguous
                vals = x_flat[flat]  # [N]
                x_flat.index_copy_(0, flat, torch.where(vals > 0, vals / rp, vals * rp))
        if need.any():
            r_idx, t_idx, counts = _counts(
                [_known_outputs(r, t) if n else () for r, t, n in zip(rows, trim.tolist(), need.tolist())],
                vocab,
            )
            sel = np.flatnonzero(need[pend_rows]) if has_pending else []
            if r_idx.size or len(sel):
                ri, ti = to_device(r_idx, dev), to_device(t_idx, dev)
                cnt = to_device(counts, dev, torch.float32)  # [N]
                if len(sel):
                    pr = pend_rows[sel]
                    pr_d, pt = to_device(pr, dev), pend_tok[to_device(sel, dev)]  # [P']
                    tok_of_row = torch.full((len(rows),), -1, dtype=pt.dtype, device=dev)
                    tok_of_row[pr_d] = pt
                    match = ti == tok_of_row[ri]  # [N]: the pair of a row's pending token
                    known = torch.zeros(len(rows), dtype=torch.float32, device=dev)
                    known.index_add_(0, ri, cnt * match)  # [R]: its count among the known ids
                    cnt = torch.cat([cnt + match, known[pr_d] + 1])  # that pair written twice, alike
                    ri, ti = torch.cat([ri, pr_d]), torch.cat([ti, pt])
                    r_idx = np.concatenate([r_idx, pr])
                fp = to_device(meta.frequency.astype(np.float32)[r_idx], dev)  # [N]
                pp = to_device(meta.presence.astype(np.float32)[r_idx], dev)  # [N]
                x.index_put_((ri, ti), x[ri, ti].sub(fp * cnt).sub(pp))

    # ------------------------------------------------------------------ random sampling

    @staticmethod
    def _probs(x: Tensor, meta: SamplingMetadata) -> Tensor:
        """Temperature, min-p, top-k, top-p; returns unnormalized probs [R, V] (masked = 0)."""
        dev = x.device
        temp = to_device(meta.temperature.astype(np.float32), dev)  # [R]
        x = x / temp.unsqueeze(1)  # [R, V], our own tensor from here on
        row_max: Tensor | None = None  # [R, 1]: min-p, top-k and top-p all keep each row's max
        if (meta.min_p > 0.0).any():
            # vLLM's order: min-p before top-k / top-p, so top-p's nucleus is one of the min-p
            # survivors' renormalized mass. p < min_p * p_max as logits: x < x_max + log(min_p)
            # (-inf for rows without min-p: nothing masked, their values untouched).
            with np.errstate(divide="ignore"):
                log_min_p = np.log(meta.min_p).astype(np.float32)  # [R]; log(0) = -inf
            row_max = x.amax(dim=-1, keepdim=True)
            thresh = row_max + to_device(log_min_p, dev).unsqueeze(1)  # [R, 1]
            x = x.masked_fill_(x < thresh, float("-inf"))
        # CUDA sorts a top-p-only row whole: the window search reads back which rows need more,
        # which would wait for the step in flight under async scheduling.
        x = _top_k_top_p(x, meta.top_k, meta.top_p, search_window=dev.type != "cuda")
        # exp(x - max) in place: the draw scales by the row total, so the softmax's normalizing
        # pass (and its output tensor) is not needed.
        x = x.sub_(x.amax(dim=-1, keepdim=True) if row_max is None else row_max)  # [R, V], max 0 per row
        if dev.type == "cpu" and (masked := _mostly_masked(meta)).any():
            # torch's vectorized CPU exp takes a slow path for -inf (and underflowing) inputs: on this
            # VM [64, 49152] mostly -inf took 12.6 ms against 1.7 finite. Rows that mask most of the
            # vocabulary take exp(max(x, -87)) - 2 exp(-87), clamped at 0 (2.8 ms): exactly 0 for
            # masked tokens, every value above ~1e-30 bitwise unchanged (absorbed); other rows
            # get -inf / 0 there, so their values never depend on the rest of the batch.
            m = torch.from_numpy(masked).to(dev).unsqueeze(1)  # [R, 1]
            floor = torch.where(m, _EXP_FLOOR, float("-inf"))  # [R, 1]
            below = torch.where(m, 2.0 * math.exp(_EXP_FLOOR), 0.0)  # [R, 1]
            probs = x.clamp_(min=floor).exp_().sub_(below).clamp_(min=0.0)  # [R, V], max 1 per row
        else:
            probs = x.exp_()  # [R, V], max 1 per row
        return probs

    def _sample(
        self, x: Tensor, rows: Sequence[SamplingRow], meta: SamplingMetadata, may_sync: bool = True
    ) -> Tensor:
        """Random rows: a draw from the truncated distribution; a row whose distribution is
        degenerate (no finite positive mass: NaN or all masked) falls back to its argmax."""
        tok, ok = self._draw(self._probs(x, meta), rows)  # [R] each
        # rare; checked on the host unless that would wait for the device (then applied blindly)
        if not may_sync or not bool(ok.all()):
            tok = torch.where(ok, tok, _argmax(x, may_sync))
        return tok

    def _draw(self, probs: Tensor, rows: Sequence[SamplingRow]) -> tuple[Tensor, Tensor]:
        """Inverse-CDF sampling, one uniform per row: token = first i with cdf[i] > u * total.

        Exact like an exponential race, but one random number per row instead of V (a full
        exponential draw dominates the CPU step at V=49k). Returns token ids [R] and whether
        each row had positive, finite mass [R] (where not, its id is meaningless but in range).
        """
        num_rows, vocab = probs.shape
        dev = probs.device
        u = torch.empty(num_rows, 1, dtype=torch.float64, device=dev)  # [R, 1]
        default_idx = [i for i, r in enumerate(rows) if r.generator is None]
        if default_idx:
            draw = torch.rand(
                len(default_idx),
                1,
                dtype=torch.float64,
                generator=self.generator,
                device=self.generator.device,
            )
            u[to_device(default_idx, dev)] = draw.to(dev)
        seeded = [(i, r.generator) for i, r in enumerate(rows) if r.generator is not None]
        if seeded:
            # Exactly one draw from each row's own generator per step, whatever the batch is.
            draws = [
                torch.rand(1, dtype=torch.float64, generator=g, device=g.device).to(dev) for _, g in seeded
            ]
            u[to_device([i for i, _ in seeded], dev)] = torch.cat(draws).unsqueeze(1)
        # Two levels: block sums pick the block holding the target, a cumsum inside that block
        # picks the token. The same inverse CDF as one fp64 cumsum over [R, V], without the fp64
        # copy and the sequential scan of the whole row (5x less time at 256 x 49k on CPU).
        bs = _DRAW_BLOCK
        full = vocab // bs * bs
        # Block sums in fp32 (256 terms: relative error ~1e-7), their running total in fp64 so the
        # tail keeps its mass (sum(dtype=float64) would first copy the whole row to fp64).
        parts = [probs[:, :full].view(num_rows, full // bs, bs).sum(-1)] if full else []
        if full < vocab:
            parts.append(probs[:, full:].sum(-1, keepdim=True))
        cdf = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # [R, NB]
        cdf = cdf.to(torch.float64).cumsum_(dim=-1)  # [R, NB]
        total = cdf[:, -1:]  # [R, 1]
        ok = (total > 0) & torch.isfinite(total)  # [R, 1]: a NaN anywhere in the row makes it NaN
        zero = torch.zeros_like(total)
        # u * total can round up to total: cap just below it, so the first cdf entry above the
        # target always belongs to mass (no host sync needed for the edge case).
        target = torch.minimum(u * total, torch.nextafter(total, zero))  # [R, 1]
        block = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)  # [R, 1]
        before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)), zero)  # [R, 1]
        cols = block * bs + torch.arange(bs, device=dev)  # [R, BS]
        inside = probs.gather(1, cols.clamp(max=vocab - 1)).masked_fill_(cols >= vocab, 0.0)
        inner = inside.to(torch.float64).cumsum_(dim=-1)  # [R, BS]
        rest = torch.minimum(target - before, torch.nextafter(inner[:, -1:], zero))  # [R, 1]
        tok = block * bs + torch.searchsorted(inner, rest, right=True).clamp_(max=bs - 1)  # [R, 1]
        return tok.squeeze(1).clamp_(max=vocab - 1), ok.squeeze(1)

    # ------------------------------------------------------------------ logprobs

    @staticmethod
    def _gather_logprobs(
        lp: Tensor,  # [Rl, V] logprobs of the rows that asked for them
        token_ids: Tensor,  # [R]
        ks: np.ndarray,  # [R] int64: each row's logprobs count (-1: not asked)
        idx: list[int],  # [Rl] the rows that asked
    ) -> list[RowLogprobs | None]:
        """The sampled token's logprob and rank, and the top k, per row that asked."""
        tok = _rows(token_ids, idx)
        k_l: list[int] = ks[idx].tolist()
        tok_lp_l, ranks_l, top_i_l, top_v_l = token_logprobs(lp, tok, max(k_l))
        return _logprob_dicts(len(token_ids), idx, k_l, tok.tolist(), tok_lp_l, ranks_l, top_i_l, top_v_l)


def _rows(t: Tensor, idx: list[int]) -> Tensor:
    """``t[idx]`` (``t`` itself when ``idx`` is every row)."""
    return t if len(idx) == len(t) else t[to_device(idx, t.device)]


def _logprob_dicts(
    num_rows: int,
    idx: list[int],
    k_l: list[int],
    tok_l: list[int],
    tok_lp_l: list[float],
    ranks_l: list[int],
    top_i_l: list[list[int]],
    top_v_l: list[list[float]],
) -> list[RowLogprobs | None]:
    """Row ``idx[j]``'s ``{token: (logprob, rank)}``: its sampled token and its top ``k_l[j]``. The
    sampled token among the top k keeps the lower rank: tied at the top, its own rank counts every
    tied logprob, its top-k place says 1 (vLLM's dict keeps that later entry)."""
    out: list[RowLogprobs | None] = [None] * num_rows
    for j, i in enumerate(idx):
        k = k_l[j]
        tok = tok_l[j]
        d: RowLogprobs = {tok: (tok_lp_l[j], ranks_l[j])}
        for rank, (t, v) in enumerate(zip(top_i_l[j][:k], top_v_l[j][:k]), start=1):
            if t not in d:
                d[t] = (v, rank)
            elif t == tok and rank < d[t][1]:
                d[t] = (d[t][0], rank)
        out[i] = d
    return out


def _token_arrays(params: SamplingParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``params.logit_bias`` as (token ids int64, biases float32) and ``params.allowed_token_ids``
    as int64 ids, built at the request's first step and kept on its parameters (they never change
    once submitted; not a field, so neither compared nor sent to a core process)."""
    cached = params.__dict__.get("_token_arrays")
    if cached is None:
        bias = params.logit_bias or {}
        cached = (
            np.fromiter(bias.keys(), dtype=np.int64, count=len(bias)),
            np.fromiter(bias.values(), dtype=np.float32, count=len(bias)),
            np.asarray(params.allowed_token_ids or [], dtype=np.int64),
        )
        params.__dict__["_token_arrays"] = cached
    return cached


def _batch_entries(
    idx: list[int], per_row: list[np.ndarray], vocab: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Rows ``idx``'s token arrays as one batch: (row of each entry, its token, the positions kept
    in the concatenation or None for all): entries at or past ``vocab`` are dropped (the engine
    refuses them; a cheap guarantee)."""
    counts = np.fromiter((len(a) for a in per_row), dtype=np.int64, count=len(per_row))
    toks = np.concatenate(per_row)
    r_idx = np.repeat(np.asarray(idx, dtype=np.int64), counts)
    if not len(toks) or toks.max() < vocab:
        return r_idx, toks, None
    pos = np.flatnonzero(toks < vocab)
    return r_idx[pos], toks[pos], pos


def _apply_allowed(x: Tensor, rows: Sequence[SamplingRow], vocab: int, idx: list[int]) -> None:
    """Rows ``idx`` keep only their allowed_token_ids' logits; every other one becomes -inf."""
    if idx:
        _keep_only(x, idx, [_token_arrays(rows[i].params)[2] for i in idx], vocab)


def _apply_choices(x: Tensor, rows: Sequence[SamplingRow], vocab: int, idx: list[int]) -> None:
    """Rows ``idx`` keep only the tokens that continue their guided_choice paths (EOS where the
    output spells a whole choice), or that their grammar accepts next (EOS once it is complete).
    Reads the output on the host: with async scheduling the step before is complete by then
    (engine ``_reads_host``)."""
    kept = [i for i in idx if rows[i].choices is not None]
    allowed = [rows[i].choices.allowed(rows[i].output_token_ids) for i in kept]  # type: ignore[union-attr]
    ended = apply_grammars(x, rows, [i for i in idx if rows[i].grammar is not None])
    kept += ended
    allowed += [rows[i].grammar.eos for i in ended]  # type: ignore[union-attr]
    if kept:
        _keep_only(x, kept, allowed, vocab)


def _may_empty(meta: SamplingMetadata, banning: list[int]) -> list[int]:
    """Rows whose masks together may leave no token: allowed_token_ids beside a grammar or choice,
    bad words or min_tokens' bans (rows ``banning``); a grammar or choice beside bad words or those
    bans. Alone, none empties a row (a finished grammar or choice allows EOS)."""
    if not (meta.allowed.any() or meta.guided.any()):  # the usual step: no per-row work
        return []
    cut = meta.bad_words.copy()  # [R] bool: bad words or min_tokens' bans
    cut[banning] = True
    return np.flatnonzero((meta.allowed & (meta.guided | cut)) | (meta.guided & cut)).tolist()


def _fallback_rows(
    fb: Tensor, rows: Sequence[SamplingRow], guard: list[int], vocab: int, eos: tuple[int, ...]
) -> Tensor:
    """``[G, V]``: what rows ``guard`` sample where their masks leave nothing, from ``fb``, their
    logits before any mask (a copy, written here). allowed_token_ids is a whitelist no other
    constraint overrides: such a row samples among its allowed ids alone; any other row ends (its
    EOS: a grammar or choice that bad words or min_tokens' bans cut off has nothing valid to add)."""
    sub = [rows[i] for i in guard]
    _apply_allowed(fb, sub, vocab, [j for j, r in enumerate(sub) if r.params.allowed_token_ids])
    ends: list[tuple[int, int]] = []
    for j, i in enumerate(guard):
        r = rows[i]
        row_eos = r.eos_token_ids or eos
        if row_eos and not r.params.allowed_token_ids:
            ends.append((j, row_eos[0]))
    _force_tokens(fb, ends)
    return fb


def _fill(x: Tensor, index: tuple[Tensor, ...], value: float) -> None:
    """``x[index] = value`` without waiting for the device. Assigned through tensor indices, a
    Python number becomes a CPU scalar that index_put_ copies to CUDA from pageable memory, which
    synchronizes the stream (caught by test_cuda_rows_that_read_the_host_sample_without_waiting
    under torch.cuda.set_sync_debug_mode("error")); a 0-dim tensor filled on the device does not."""
    x.index_put_(index, x.new_full((), value))


def _keep_only(x: Tensor, idx: list[int], per_row: list[np.ndarray], vocab: int) -> None:
    """Rows ``idx`` keep only the logits of their ``per_row`` token ids; the rest become -inf."""
    r_idx, toks, _ = _batch_entries(idx, per_row, vocab)
    dev = x.device
    r, t = to_device(r_idx, dev), to_device(toks, dev)
    kept = x[r, t]
    _fill(x, (to_device(idx, dev),), _NEG_INF)
    x[r, t] = kept


def _apply_bad_words(x: Tensor, rows: Sequence[SamplingRow], vocab: int, idx: list[int]) -> None:
    """Rows ``idx``: each bad word's last token is -inf where the row's output ends with the tokens
    before it (one-token words at every step), one scatter for the batch. A row with a word of
    several tokens reads its output on the host: with async scheduling the step before is
    complete by then (engine ``_reads_host``), so no such row is pending."""
    per_row: list[np.ndarray] = []
    kept: list[int] = []
    for i in idx:
        bw = rows[i].bad_words
        if bw is None:
            continue
        extra = bw.banned(rows[i].output_token_ids)
        per_row.append(np.concatenate([bw.single, np.asarray(extra, dtype=np.int64)]) if extra else bw.single)
        kept.append(i)
    if kept:
        r_idx, toks, _ = _batch_entries(kept, per_row, vocab)
        if len(toks):
            _fill(x, (to_device(r_idx, x.device), to_device(toks, x.device)), _NEG_INF)


def _apply_logit_bias(x: Tensor, rows: Sequence[SamplingRow], vocab: int, idx: list[int]) -> None:
    """x[row, token] += bias for the logit_bias of rows ``idx`` (one scatter for the batch; each
    request's bias as arrays built once, so a step's host work is per row, not per entry)."""
    if not idx:
        return
    arrays = [_token_arrays(rows[i].params) for i in idx]
    r_idx, toks, pos = _batch_entries(idx, [a[0] for a in arrays], vocab)
    if len(toks):
        dev = x.device
        values = np.concatenate([a[1] for a in arrays])
        values = values if pos is None else values[pos]
        x.index_put_(
            (to_device(r_idx, dev), to_device(toks, dev)),
            to_device(values, dev, x.dtype),
            accumulate=True,
        )


def token_logprobs(
    lp: Tensor,  # [R, V] logprobs
    targets: Tensor,  # [R] int64 token ids
    k: int,
) -> tuple[list[float], list[int], list[list[int]], list[list[float]]]:
    """Per row: the logprob of ``targets[r]``, its rank as vLLM counts it (how many tokens have a
    logprob at least as high), and the top ``k`` ids and logprobs (empty lists for k = 0). The
    sampler's logprobs and prompt logprobs both read them here.

    On CPU through numpy, where torch's reductions are not vectorized: 64 rows x 49,152 on one
    thread, the rank count 1.5 ms against 6.7 (a bool sum) and 2.7 (an int32 sum), the top 1
    (``argmax``, the first maximum) 0.4 ms against 4.0 (``topk(1)``) and 2.7 (``max``); ``topk``
    for k > 1 (``argpartition`` is 6x slower)."""
    cpu = lp.device.type == "cpu"
    if cpu:
        a = lp.contiguous().numpy()  # [R, V]
        tok = np.take_along_axis(a, targets.numpy()[:, None], 1)  # [R, 1]
        tok_l, ranks_l = tok[:, 0].tolist(), np.count_nonzero(a >= tok, axis=-1).tolist()
    else:
        tok_lp, ranks, top = _logprob_tensors(lp, targets, k)
        tok_l, ranks_l = tok_lp.tolist(), ranks.tolist()
        if top is not None:
            return tok_l, ranks_l, top[0].tolist(), top[1].tolist()
    if k <= 0:
        return tok_l, ranks_l, [[] for _ in tok_l], [[] for _ in tok_l]
    if k == 1 and cpu:
        top_i = np.argmax(a, axis=-1)[:, None]  # [R, 1]
        return tok_l, ranks_l, top_i.tolist(), np.take_along_axis(a, top_i, 1).tolist()
    top_v, top_i_t = lp.max(dim=-1, keepdim=True) if k == 1 else lp.topk(k, dim=-1)  # [R, k] each
    return tok_l, ranks_l, top_i_t.tolist(), top_v.tolist()


def _logprob_tensors(
    lp: Tensor,  # [R, V] logprobs
    targets: Tensor,  # [R] int64 token ids
    k: int,
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """``token_logprobs`` on the device, nothing read back: ``[R]`` logprobs of the targets, their
    ``[R]`` int32 ranks, and the top ``k`` ``(ids, logprobs)``, each ``[R, k]`` (None for k = 0)."""
    tok_t = lp.gather(1, targets[:, None])  # [R, 1]
    ranks = torch.ge(lp, tok_t).sum(dim=-1, dtype=torch.int32)  # [R]
    if k <= 0:
        return tok_t.squeeze(1), ranks, None
    top_v, top_i = lp.max(dim=-1, keepdim=True) if k == 1 else lp.topk(k, dim=-1)  # [R, k] each
    return tok_t.squeeze(1), ranks, (top_i, top_v)


def _argmax(x: Tensor, may_sync: bool = True) -> Tensor:
    """Row-wise argmax [R] of x [R, V] that never picks a NaN over a real value (torch's argmax
    propagates NaN); the NaN-free pass runs only for rows that need it. Ties: the first maximum,
    as torch's (and so HF's greedy) argmax.

    On CPU, numpy's argmax: 1.5 ms against torch's 10.6 ms (``max(dim=-1)``: 11.1 ms) for
    [256, 49152] fp32 on one thread of the 2-core EPYC here, where torch's index reductions are
    not vectorized; elsewhere ``max``, which hands back the values for the NaN check too."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        a = x.contiguous().numpy()  # [R, V]
        tok_np = np.argmax(a, axis=-1)  # [R]; a row holding a NaN gives its first NaN
        rows = np.arange(a.shape[0])
        nan_rows = rows[np.isnan(a[rows, tok_np])]
        if nan_rows.size:
            clean = np.where(np.isnan(a[nan_rows]), -np.inf, a[nan_rows])
            tok_np[nan_rows] = np.argmax(clean, axis=-1)
        return torch.from_numpy(tok_np)
    vals, tok = x.max(dim=-1)
    nan = vals.isnan()  # [R]: NaN only where the row holds one (max propagates it)
    if not may_sync or bool(nan.any()):  # no_sync: a second pass instead of reading the check back
        tok = torch.where(nan, torch.nan_to_num(x, nan=_NEG_INF).argmax(dim=-1), tok)
    return tok


def _thinking_spent(rows: Sequence[SamplingRow], meta: SamplingMetadata) -> list[tuple[int, int]]:
    """``(row, token)`` for the rows whose thinking block is open and has spent its budget: the
    token their next must be (the budget's message, then the end tag)."""
    if not meta.thinking.any():
        return []
    spent: list[tuple[int, int]] = []
    for i in np.flatnonzero(meta.thinking).tolist():
        t = rows[i].thinking
        if t is not None and (tok := t.next_forced(rows[i].output_token_ids)) is not None:
            spent.append((i, tok))
    return spent


def _force_tokens(x: Tensor, forced: list[tuple[int, int]]) -> None:
    """Each ``(row, token)`` of ``forced`` can sample only that token (for a spent thinking
    budget: after every other mask, so no other constraint leaves the row without one)."""
    if forced:
        dev = x.device
        r = to_device([i for i, _ in forced], dev)
        _fill(x, (r,), _NEG_INF)
        _fill(x, (r, to_device([t for _, t in forced], dev)), 0.0)


def _below_min_tokens(rows: Sequence[SamplingRow], meta: SamplingMetadata) -> list[int]:
    """The rows that have generated fewer than their min_tokens (their outputs are counted only
    when some row has a min_tokens)."""
    if not meta.min_tokens.any():
        return []
    out_lens = np.fromiter((len(r.output_token_ids) for r in rows), dtype=np.int64, count=len(rows))
    return np.flatnonzero(out_lens < meta.min_tokens).tolist()


def _known_outputs(row: SamplingRow, trimmed: bool) -> Sequence[int]:
    """The row's output ids known on the host: all but the last when that is a placeholder."""
    return row.output_token_ids[:-1] if trimmed else row.output_token_ids


def _occurrences(
    rows: Sequence[SamplingRow], idx: list[int], vocab: int, trim: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``rows [N]``, ``tokens [N]``: each of rows ``idx``'s distinct in-vocabulary prompt ids (kept on
    the row after the first call) and every in-vocabulary output id, repeats included (``trim``:
    rows whose last output id is left out)."""
    prompts = []
    for i in idx:
        row = rows[i]
        if row.prompt_ids is None:
            p = np.unique(np.asarray(row.prompt_token_ids, dtype=np.int64))
            row.prompt_ids = p[(p >= 0) & (p < vocab)]
        prompts.append(row.prompt_ids)
    outs = [_known_outputs(rows[i], trim is not None and bool(trim[i])) for i in idx]
    out_lens = np.fromiter(map(len, outs), dtype=np.int64, count=len(idx))
    out_toks = np.fromiter(chain.from_iterable(outs), dtype=np.int64, count=int(out_lens.sum()))  # [M]
    ok = (out_toks >= 0) & (out_toks < vocab)
    at = np.asarray(idx, dtype=np.int64)
    prompt_lens = np.fromiter(map(len, prompts), dtype=np.int64, count=len(idx))
    r_idx = np.concatenate([np.repeat(at, prompt_lens), np.repeat(at, out_lens)[ok]])
    return r_idx, np.concatenate([*prompts, out_toks[ok]])


def _counts(token_lists: Sequence[Sequence[int]], vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct (row, token) pairs of ragged per-row token lists (read in place; out-of-range
    ids dropped) as ``rows [N]``, ``tokens [N]`` and how often each occurs ``[N]``. numpy:
    torch.tensor() on a long Python list costs ~10x more."""
    lens = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
    toks = np.fromiter(chain.from_iterable(token_lists), dtype=np.int64, count=int(lens.sum()))  # [M]
    row_of = np.repeat(np.arange(len(token_lists), dtype=np.int64), lens)  # [M]
    ok = (toks >= 0) & (toks < vocab)
    uniq, cnt = np.unique(row_of[ok] * vocab + toks[ok], return_counts=True)
    return uniq // vocab, uniq % vocab, cnt


# ---------------------------------------------------------------------- truncation

# Vocabulary block of the two-level draw (sums over blocks, then a cumsum inside one).
_DRAW_BLOCK = 256

# top-p looks for its cut among this many best tokens first, then among _TOP_P_WIDE, and only
# then sorts the row. One thread here, 49,152 vocabulary: topk(256) 0.17 ms per row, topk(4096)
# 0.61 ms, a full sort 3.9 ms. SmolLM2's sampled rows at temperature 0.8 need more than 256
# tokens for top_p 0.95 / 0.99 in 4% / 19% of rows, more than 4096 in 0% / 0.6%.
_TOP_P_WINDOW = 256
_TOP_P_WIDE = 4096


_EXP_FLOOR = -87.0  # exp(-87) ~ 1.6e-38: float32's smallest normal numbers


def _mostly_masked(meta: SamplingMetadata) -> np.ndarray:
    """[R] bool: rows whose logits are -inf for most tokens by now (top-k, top-p, min-p, allowed
    ids, a choice or grammar)."""
    return (meta.top_k > 0) | (meta.top_p < 1.0) | (meta.min_p > 0.0) | meta.allowed | meta.guided


def _top_k_top_p(
    x: Tensor,
    top_k: Sequence[int] | np.ndarray,
    top_p: Sequence[float] | np.ndarray,
    search_window: bool = True,
) -> Tensor:
    """Mask x [R, V] to each row's top-k, then to the top-p nucleus of the renormalized top-k.

    top-p keeps a token while the mass strictly before it is < top_p, so the token that
    crosses top_p is kept and the best token always is (vLLM's rule). ``search_window``: a
    top-p-only row looks for its cut among its best ``_TOP_P_WINDOW`` tokens first (the host
    reads back which rows need more); off: every active row is sorted whole, with no read back
    (vLLM's GPU sampler sorts the whole vocabulary too). The masks are the same.
    """
    num_rows, vocab = x.shape
    dev = x.device
    ks = [k if 0 < k < vocab else 0 for k in np.asarray(top_k, dtype=np.int64).tolist()]  # 0: no top-k
    # 0: no top-p (1.0 is off: cumsum can hit 1 early)
    ps = [p if p < 1.0 else 0.0 for p in np.asarray(top_p, dtype=np.float64).tolist()]
    active = [i for i in range(num_rows) if ks[i] or ps[i]]
    if not active:
        return x
    need_full = [i for i in active if ps[i] and not ks[i]]
    first = _TOP_P_WINDOW if search_window else vocab
    window = min(vocab, max([ks[i] for i in active] + ([first] if need_full else [0])))

    # Every row active (the usual batch): no gather of the rows and no copy of x for the result.
    all_active = len(active) == num_rows
    a_idx = to_device(active, dev)
    xa = x if all_active else x[a_idx]  # [A, V]
    vals, idx = torch.topk(xa, window, dim=-1, sorted=True)  # [A, W] each, descending
    k_t = to_device([ks[i] or window for i in active], dev).unsqueeze(1)  # [A, 1]
    pos = torch.arange(window, device=dev).unsqueeze(0)  # [1, W]
    drop = pos >= k_t  # [A, W]
    vals = vals.masked_fill(drop, float("-inf"))
    # Normalizer: the kept top-k for top-k rows, the whole row for top-p-only rows.
    has_k_rows = [bool(ks[i]) for i in active]
    row_lse = None if all(has_k_rows) else xa.logsumexp(dim=-1, keepdim=True)  # [A, 1]
    if row_lse is None:
        lse = vals.logsumexp(dim=-1, keepdim=True)
    elif not any(has_k_rows):
        lse = row_lse
    else:
        has_k = to_device(has_k_rows, dev).unsqueeze(1)  # [A, 1]
        lse = torch.where(has_k, vals.logsumexp(dim=-1, keepdim=True), row_lse)
    sp = torch.exp(vals - lse)  # [A, W]
    cum = sp.cumsum(dim=-1)  # [A, W]
    p_t = to_device([ps[i] or 2.0 for i in active], dev, torch.float32).unsqueeze(1)
    drop = drop | ((cum - sp) >= p_t)
    drop[:, 0] = False
    keep = torch.full_like(xa, float("-inf")).scatter_(1, idx, vals.masked_fill(drop, float("-inf")))

    if all_active:
        out = keep
    else:
        out = x.clone()
        out[a_idx] = keep
    # Top-p-only rows whose nucleus extends past the window: redo them with a full sort.
    if need_full and window < vocab:
        short = (cum[:, -1:] < p_t).squeeze(1).tolist()  # window mass below top_p
        redo_pos = [j for j, i in enumerate(active) if short[j] and not ks[i]]
        redo = [active[j] for j in redo_pos]
        if redo:
            r_idx = to_device(redo, dev)
            xr = x[r_idx]  # [F, V]
            pr = to_device([ps[i] for i in redo], dev, torch.float32).unsqueeze(1)
            masked = xr  # a copy (gathered rows): written in place below
            full = torch.arange(len(redo), device=dev)
            if _TOP_P_WIDE < vocab:  # a wider window first; rows whose nucleus is wider still: sorted
                assert row_lse is not None  # top-p-only rows exist
                lse_r = row_lse[to_device(redo_pos, dev)]  # [F, 1]
                masked, short_w = _nucleus_in_window(xr, pr, _TOP_P_WIDE, lse_r)
                full = short_w.nonzero().squeeze(1)
            if full.numel():
                xf, pf = xr[full], pr[full]
                sv, order = torch.sort(xf, dim=-1, descending=True, stable=True)  # [F', V] each
                sp = torch.softmax(sv, dim=-1)
                drop = (sp.cumsum(dim=-1) - sp) >= pf  # [F', V]
                drop[:, 0] = False
                masked[full] = xf.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), float("-inf"))
            out[r_idx] = masked
    return out


def _nucleus_in_window(xr: Tensor, pr: Tensor, window: int, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Top-p masks of rows ``xr [F, V]`` (top-p only) from their ``window`` best tokens, as the
    first window above does it, and which rows hold less than their top-p in the window (their
    mask is incomplete: the caller sorts them). ``lse [F, 1]``: each row's logsumexp."""
    vals, idx = torch.topk(xr, window, dim=-1, sorted=True)  # [F, W] each, descending
    sp = torch.exp(vals - lse)  # [F, W]
    cum = sp.cumsum(dim=-1)  # [F, W]
    drop = (cum - sp) >= pr
    drop[:, 0] = False
    keep = torch.full_like(xr, float("-inf")).scatter_(1, idx, vals.masked_fill(drop, float("-inf")))
    return keep, (cum[:, -1:] < pr).squeeze(1)
