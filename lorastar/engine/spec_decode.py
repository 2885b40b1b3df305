"""Speculative decoding's host side (torch-free): prompt-lookup drafts (vLLM's ngram proposer, the
tokens that followed an earlier occurrence of the sequence's last n tokens), their verification
rule and its counters. The engine runs the drafts and verifies them (engine.py).

Verification: a drafted sequence's step gives ``1 + d`` logits rows, row ``i`` predicting the token
after draft ``i`` (row 0: after the last real token). Each row is sampled as a normal step would
sample it; the output is the sampled tokens up to and including the first that differs from its
draft. For a draft that is a fixed token (an n-gram's, probability 1 under the proposer), this is
speculative sampling's rule exactly: the draft is kept with probability ``p(draft)``, and a rejected
row's token is distributed as ``p`` without the draft, renormalized; greedy keeps the argmax chain.
So the outputs' distribution is the model's own."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

if TYPE_CHECKING:
    from lorastar.engine.request import Sequence


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` drafted tokens for ``tokens [L]`` (prompt + output so far): the longest suffix
    n-gram (``min_n <= n <= max_n``) found earlier in ``tokens``, at its earliest occurrence, and the
    tokens after it (fewer than ``k`` where the sequence ends first); ``[]`` where no n-gram matches.
    vLLM's ``_find_longest_matched_ngram_and_propose_tokens`` (same match, same drafts).

    Semantics: ``i = min{i : tokens[i:i+n] == tokens[L-n:], i + n < L}`` for the largest such ``n``;
    drafts ``tokens[i+n : i+n+k]``. Cost O(L * n) in numpy per tried ``n``."""
    size = tokens.shape[0]
    if k <= 0 or size < min_n + 1:
        return []
    head = tokens[: size - 1]  # a match must end before the last token (something follows it)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n :]
        # Candidates by their first token, then the whole n-gram: most starts fail on the first.
        starts = np.flatnonzero(head[: size - n] == suffix[0])
        if n > 1 and starts.size:
            windows = sliding_window_view(head, n)  # [size - n, n], a view
            starts = starts[(windows[starts] == suffix).all(axis=1)]
        if starts.size:
            i = int(starts[0]) + n
            return tokens[i : i + k].tolist()
    return []


def accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many leading ``drafts [d]`` the rows' ``sampled [d + 1]`` tokens confirm; the output is
    ``sampled[: accepted + 1]``."""
    j = 0
    for d, t in zip(drafts, sampled):
        if d != t:
            break
        j += 1
    return j


def token_array(seq: Sequence) -> np.ndarray:
    """``seq.token_ids`` as a ``[num_tokens]`` int64 view of its drafter buffer, topped up with the
    tokens appended since the last call (a drafting sequence's tokens only grow: no beams, no
    placeholders). Converting the whole list each step cost 19 ms a step at 256 sequences of 4,000
    tokens; the search itself a fraction of that."""
    n = seq.num_tokens
    buf, have = seq.token_buf, seq.token_buf_len
    if buf is None or buf.shape[0] < n:
        grown = np.empty(max(2 * n, 64), dtype=np.int64)
        if buf is not None:
            grown[:have] = buf[:have]
        buf = seq.token_buf = grown
    if n > have:
        buf[have:n] = seq.token_ids[have:n]
    seq.token_buf_len = n
    return buf[:n]
