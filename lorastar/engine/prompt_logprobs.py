"""Prompt logprobs (vLLM's ``prompt_logprobs``), computed during prefill a few rows at a time.

A prefill chunk of ``n`` tokens starting at position ``s`` has hidden rows that predict positions
``s + 1 .. s + n``; those still inside the prompt are scored here. Logits are projected and
reduced in blocks of rows so about ``max_bytes`` of fp32 logits exist at once: a 4k-token
prompt over a 49k vocabulary never materializes the 800 MB ``[prompt_len, vocab]`` tensor.

Prefix caching (decided here): a request that asks for prompt logprobs may use cached KV blocks
only where their positions' logprobs were kept too. ``PromptLogprobsCache`` keeps, per full prompt
block (keyed by the prefix cache's own hash: model, adapter and every token up to the block's end),
the entries of the block's positions and the final hidden row of its last token. A request whose
first ``c`` blocks hit takes positions ``< c * block_size`` from the kept entries and scores
position ``c * block_size`` from the kept row of block ``c - 1``; it computes the rest. Multiple
choice evaluation (one context, several continuations) computes each context once. Values equal a
cold run's up to the float order of a different batch (the tests hold them to 1e-4).

Semantics (one block): ``lp = log_softmax(compute_logits(hidden).float()); tok = lp[r, target[r]];
rank = (lp >= tok).sum(-1); top = lp.topk(k)`` — raw model logprobs (no temperature, penalties
or logit_bias), the ranks counted as vLLM does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lorastar.engine.sampler import MIN_LOGPROB, token_logprobs

# 8 MiB of fp32 logits per block (42 rows of SmolLM2's 49,152-token vocabulary). Measured on this
# CPU (2 threads, 4,096 rows, hidden 576, k=5): 5.3 s at 21 rows per block, 3.7 s at 42, 3.6 s at
# 85, 2.9 s at 256 (48 MiB), 6.7 s all at once; 8 MiB keeps most of the speed for a few MB.
DEFAULT_MAX_BYTES = 8 << 20


@dataclass
class PromptTokenLogprobs:
    """One prompt position: its token's logprob and rank, and the top ``k`` (ids, logprobs)."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


def rows_per_block(vocab_size: int, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    return max(1, max_bytes // (4 * vocab_size))


@torch.inference_mode()
def score_prompt_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,  # [m, hidden]: rows predicting the targets
    targets: list[int],  # [m] the prompt tokens at the next positions
    k: int,
    vocab_size: int,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> list[PromptTokenLogprobs]:
    """Logprob, rank and top-``k`` of ``targets[r]`` under ``hidden[r]``, block by block."""
    out: list[PromptTokenLogprobs] = []
    step = rows_per_block(vocab_size, max_bytes)
    tgt = torch.tensor(targets, dtype=torch.int64, device=hidden.device)  # [m]
    for a in range(0, len(targets), step):
        b = min(a + step, len(targets))
        lp = torch.log_softmax(compute_logits(hidden[a:b]).float(), dim=-1)  # [rows, vocab]
        lp.nan_to_num_(nan=MIN_LOGPROB, neginf=MIN_LOGPROB, posinf=0.0)
        tok_l, ranks_l, top_il, top_vl = token_logprobs(lp, tgt[a:b], k)
        del lp
        for v, r, ti, tv in zip(tok_l, ranks_l, top_il, top_vl):
            out.append(PromptTokenLogprobs(v, r, ti, tv))
    return out


@dataclass
class KeptBlock:
    """One full prompt block's prompt logprobs (``None`` at position 0) and its last row."""

    k: int  # top-k kept per entry
    entries: list[PromptTokenLogprobs | None]  # [block_size]
    last_hidden: torch.Tensor  # [hidden] final hidden row of the block's last token


class PromptLogprobsCache:
    """LRU of ``KeptBlock`` by prefix-cache block hash, at most ``max_blocks`` (about 5 KB each
    for SmolLM2 at k = 1: 16 entries and a 576-float row) holding at most ``max_top`` top-k
    entries in all (``k`` per position; each about 70 bytes as Python numbers, so ~90 MB at most).
    The second bound is what holds with a raised ``max_logprobs``: one 16-token block at k = 49,152
    (a request's -1) keeps about 55 MB and evicts the rest; a block over the whole budget is not
    kept."""

    def __init__(self, max_blocks: int = 4096, max_top: int = 4096 * 16 * 20) -> None:
        self.max_blocks = max_blocks
        self.max_top = max_top
        self.num_top = 0  # top-k entries held: sum of k * positions over the kept blocks
        self._blocks: OrderedDict[bytes, KeptBlock] = OrderedDict()

    @staticmethod
    def _top(block: KeptBlock) -> int:
        return block.k * len(block.entries)

    def fits(self, block: KeptBlock, chain: int) -> bool:
        """Whether ``block``, the ``chain``-th of its prompt, can be kept with the ``chain - 1``
        before it (blocks of one prompt hold the same k): a hit needs them all, and a block whose
        chain is over the budget would evict its own prefix and never be hit."""
        return chain * self._top(block) <= self.max_top

    def clear(self) -> None:
        self._blocks.clear()
        self.num_top = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: bytes, k: int) -> KeptBlock | None:
        """The kept block if it holds at least the top ``k`` (refreshing its LRU position)."""
        b = self._blocks.get(key)
        if b is None or b.k < k:
            return None
        self._blocks.move_to_end(key)
        return b

    def put(self, key: bytes, block: KeptBlock) -> None:
        old = self._blocks.get(key)
        if old is not None and old.k >= block.k:
            self._blocks.move_to_end(key)
            return
        if self._top(block) > self.max_top:  # more than the whole budget: not kept
            return
        if old is not None:
            self.num_top -= self._top(old)
        self._blocks[key] = block
        self._blocks.move_to_end(key)
        self.num_top += self._top(block)
        while len(self._blocks) > self.max_blocks or self.num_top > self.max_top:
            _, gone = self._blocks.popitem(last=False)
            self.num_top -= self._top(gone)
