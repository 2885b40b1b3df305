"""A thinking budget (vLLM's ``SamplingParams.thinking_token_budget``): a reasoning model's
thinking block is closed once it holds that many tokens, by allowing only the budget's message
(``thinking_budget_message_ids``, if any), then its end tag, one token a step. The
sampler reads each budgeted row's state here (``ThinkingBudget``), on the host: with async
scheduling the step before is complete by then (engine ``_reads_host``)."""

from __future__ import annotations

from collections.abc import Sequence


class ThinkingBudget:
    """One sampling sequence's thinking block, followed over its output for
    ``SamplingParams.thinking_token_budget``: once the block holds that many tokens (its tags not
    counted) and is still open, the next tokens can only be the budget's message, one by one, then
    the end tag (``forced``).

    The block is open from the first output token with ``think_end`` set and no ``think_start``
    (DeepSeek-R1's style: the template leaves the prompt inside it), or from a first output token
    that is ``think_start`` (Qwen3's); an output that starts otherwise has no block. Advanced lazily
    over the output's new ids, as ``GrammarRow`` is, so a fork or a recomputed sequence catches up
    from its output alone."""

    __slots__ = ("budget", "think_start", "think_end", "forced", "seen", "inside", "count", "done")

    def __init__(
        self, budget: int, think_start: int | None, think_end: int, message: Sequence[int] = ()
    ) -> None:
        self.budget, self.think_start, self.think_end = budget, think_start, think_end
        self.forced = (*message, think_end)  # written once the budget is spent
        self._reset()

    def _reset(self) -> None:
        self.seen = 0  # output ids read
        self.inside = self.think_start is None  # in the block
        self.count = 0  # tokens in the block so far
        self.done = False  # the block closed, or the output opened without one

    def next_forced(self, output: Sequence[int]) -> int | None:
        """The token the next one must be (the message's next, or the end tag), or None where the
        budget does not bind, after reading ``output``'s new ids. The message's tokens count as
        the block's: the k-th token past the budget is ``forced[k]``."""
        n = len(output)
        if n < self.seen:  # an output never shrinks; a guard, not a path
            self._reset()
        for i in range(self.seen, n):
            if self.done:
                break
            self._read(i, int(output[i]))
        self.seen = n
        return self._forced()

    def _read(self, i: int, tok: int) -> None:
        """The block's state after output token ``i`` (``tok``), the block not yet done."""
        if self.inside:
            if tok == self.think_end:
                self.inside, self.done = False, True
            else:
                self.count += 1
        elif i == 0 and tok == self.think_start:
            self.inside = True
        else:
            self.done = True

    def _forced(self) -> int | None:
        past = self.count - self.budget
        return self.forced[past] if self.inside and 0 <= past < len(self.forced) else None

    def valid_drafts(self, output: Sequence[int], drafts: Sequence[int]) -> int:
        """How many leading ``drafts`` may follow ``output``: a draft other than the token the budget
        forces at its position could never be kept, so it and the rest are not run (as a grammar's
        refused drafts, ``GrammarRow.valid_drafts``). Reads ``output`` for good and ends as it was
        after it."""
        self.next_forced(output)
        state = self.checkpoint()
        k = 0
        for tok in drafts:
            forced = self._forced()
            if forced is not None and tok != forced:
                break
            if not self.done:
                self._read(self.seen, tok)
            self.seen += 1
            k += 1
        self.restore(state)
        return k

    def checkpoint(self) -> tuple[int, bool, int, bool]:
        """The block's state, for ``restore`` (speculative decoding reads drafted positions, then
        takes them back)."""
        return self.seen, self.inside, self.count, self.done

    def restore(self, state: tuple[int, bool, int, bool]) -> None:
        self.seen, self.inside, self.count, self.done = state
