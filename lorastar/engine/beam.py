"""Beam search bookkeeping (torch-free), following HF transformers' beam search.

Each step every live beam proposes its top ``2 * width`` continuations (log-prob of the token
plus the beam's running sum). Over all proposals, best first: an EOS continuation among the top
``width`` ranks becomes a finished hypothesis (score = sum / generated_len ** length_penalty;
a stop token id ends one as EOS does, HF's ``eos_token_id`` list);
other continuations fill the ``width`` new beams. The request is done when ``width`` hypotheses
are finished and no running beam can beat the worst of them, or at ``max_tokens``.

With ``logprobs`` asked for, each beam's step keeps its top entries (``step_logprobs``) and every
generated token of a hypothesis gets one list of them (the token first, then the top
``logprobs``), as a sampled token does; their logprobs sum to the hypothesis's ``sum_logprob``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens (prompt excluded), EOS included when it ended on one
    sum_logprob: float
    score: float
    source: int = -1  # the seq_id it came from (its parent, when it ended on a proposal)
    logprobs: list[list[tuple[int, float, int]]] | None = None  # per token, when asked for


@dataclass
class BeamState:
    width: int
    length_penalty: float
    eos_token_ids: tuple[int, ...]
    ignore_eos: bool
    stop_token_ids: tuple[int, ...] = ()  # end a hypothesis as EOS does (ignore_eos or not)
    # seq_id -> that beam's proposals this step: [(sum_logprob, token)], best first
    pending: dict[int, list[tuple[float, int]]] = field(default_factory=dict)
    # logprobs asked for: seq_id -> that beam's top (token, logprob) this step, best first (at least
    # its proposals and the top ``num_logprobs``)
    num_logprobs: int | None = None
    step_logprobs: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    finished: list[Hypothesis] = field(default_factory=list)
    done: bool = False

    @property
    def end_ids(self) -> tuple[int, ...]:
        """The tokens that end a hypothesis (``min_tokens`` masks them until then)."""
        return (() if self.ignore_eos else self.eos_token_ids) + self.stop_token_ids

    def normalized(self, sum_logprob: float, gen_len: int) -> float:
        return sum_logprob / (max(gen_len, 1) ** self.length_penalty)

    def add_finished(self, hyp: Hypothesis) -> None:
        self.finished.append(hyp)
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[self.width :]

    def select(self, beams: list[tuple[int, list[int], float]]) -> list[tuple[int, int, float]]:
        """Choose the next beams. ``beams``: live (seq_id, generated tokens, sum_logprob) in beam
        order, each with its proposals in ``pending``. Returns ``[(parent seq_id, token, new sum)]``
        (at most ``width``; empty when the search is done)."""
        cands: list[tuple[float, int, int, int]] = []  # (sum, beam order, token rank, token)
        for order, (sid, _, _) in enumerate(beams):
            for rank, (s, tok) in enumerate(self.pending[sid]):
                cands.append((s, order, rank, tok))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        cands = cands[: 2 * self.width]
        chosen: list[tuple[int, int, float]] = []
        ends = self.end_ids
        for rank, (s, order, _, tok) in enumerate(cands):
            sid, gen, _ = beams[order]
            if tok in ends:
                if rank < self.width:
                    toks = [*gen, tok]
                    self.add_finished(Hypothesis(toks, s, self.normalized(s, len(toks)), sid))
                continue
            chosen.append((sid, tok, s))
            if len(chosen) == self.width:
                break
        self.pending.clear()
        if len(self.finished) >= self.width and chosen:
            gen_len = len(beams[0][1]) + 1
            best_running = max(self.normalized(s, gen_len) for _, _, s in chosen)
            if self.finished[-1].score >= best_running:
                self.done = True
        if not chosen:
            self.done = True
        return [] if self.done else chosen

    def finish_all(self, beams: list[tuple[int, list[int], float]]) -> None:
        """Length limit: every live beam becomes a hypothesis."""
        for sid, gen, s in beams:
            self.add_finished(Hypothesis(list(gen), s, self.normalized(s, len(gen)), sid))
        self.done = True

    def token_logprobs(self, seq_id: int, token: int) -> list[tuple[int, float, int]]:
        """The raw logprobs entry of ``token`` proposed by beam ``seq_id`` this step: ``(token,
        logprob, rank)`` first (rank: how many of the beam's top logprobs are >= it, as the sampler
        counts a tie), then the top ``num_logprobs`` with ranks 1, 2, ..."""
        top = self.step_logprobs[seq_id]
        v = next(lp for t, lp in top if t == token)
        rank = sum(1 for _, lp in top if lp >= v)
        return [
            (token, v, rank),
            *((t, lp, i + 1) for i, (t, lp) in enumerate(top[: self.num_logprobs or 0])),
        ]
