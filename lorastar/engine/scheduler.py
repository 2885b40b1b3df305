"""Iteration-level scheduler (torch-free).

Each step: running sequences first (decodes and unfinished prefill chunks, oldest first),
then waiting ones (FIFO), within a token budget, ``max_num_seqs`` and ``max_loras`` distinct
adapters. When blocks run out, the newest running sequence is preempted by recompute (its
blocks are freed; it goes back to the front of the queue and recomputes prompt + output,
mostly from the prefix cache).

``policy="priority"`` (vLLM's ``--scheduling-policy priority``): every order above is by
``(request.priority, arrival)`` instead, lower values first. Running sequences take the step's
budget in that order (decodes before prefill chunks within one priority), the waiting queue is
kept sorted by it (a preempted sequence is re-queued at its place), and the sequence preempted
when blocks run out is the lowest-priority, latest-arrived one not yet scheduled this step. A
waiting request that finds every ``max_num_seqs`` seat taken preempts running sequences of a
strictly lower priority (the lowest first) to get in, before the step schedules anyone: an
interactive request does not wait for a batch job's requests to finish (vLLM v1 waits: its issue
#40004), when enough of them free enough seats (else no one is preempted). Equal priorities never
preempt each other (no ping-pong); beam searches neither take seats this way nor give theirs, and
sequences about to end keep theirs; a sequence preempted for a seat does not get one back in the
same step.

In-batch prefix sharing (SGLang's idea): a waiting sequence whose next uncached prompt block is
being computed right now by a running one (same tokens, same adapter: same block hash) waits until
that block is committed and then takes it from the prefix cache, instead of computing it a second
time in the same step. Requests that share a long prefix and arrive together (lm-eval's choices of
one question, n parallel users of one system prompt) compute it once. A sequence is held back at most
``max_prefix_waits`` steps (0: never; the engine uses 32).
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lorastar.engine.block_manager import NULL_BLOCK, BlockManager
from lorastar.engine.request import Request, SeqStatus, Sequence

# ensure_adapter(seq, pinned_keys) -> bool: make the sequence's adapter resident in a device slot
# without evicting any pinned one (content hashes); False if impossible this step.
EnsureAdapter = Callable[[Sequence, set[str]], bool]


@dataclass(slots=True, init=False)
class ScheduledSeq:
    seq: Sequence
    start: int  # tokens already in the KV cache before this step
    num_new_tokens: int
    # Whether this step produces a token for the sequence (its last chunk). Fixed when scheduled:
    # it stays true after the sampled token is appended.
    samples: bool
    # Drafted tokens among the new ones (the last ``num_drafts``; speculative decoding): the step
    # produces a token for each of them too, and keeps those the drafts predicted right.
    num_drafts: int

    def __init__(self, seq: Sequence, start: int, num_new_tokens: int) -> None:
        # (written out: one of these per scheduled sequence a step, and a generated __init__
        # calling __post_init__ costs more)
        self.seq = seq
        self.start = start
        self.num_new_tokens = num_new_tokens
        self.samples = start + num_new_tokens == len(seq.token_ids)
        self.num_drafts = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences finished since the previous schedule (the runner gives back their batch rows).
    finished_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_waits: int = 0  # steps a waiting sequence was held back for a block being computed


def priority_key(seq: Sequence) -> tuple[int, float, int]:
    """``policy="priority"``'s order: lower priority values first, then earlier arrivals (a request's
    samples in their order)."""
    return (seq.request.priority, seq.request.arrival_time, seq.seq_id)


def _seats(seq: Sequence) -> int:
    """``max_num_seqs`` seats a running sequence holds: an n > 1 request not yet forked holds
    the seats of the samples it will fork into."""
    req = seq.request
    return req.params.n if (req.params.n > 1 and not req.forked and seq.index == 0) else 1


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_loras: int,
        ensure_adapter: EnsureAdapter | None = None,
        starvation_steps: int = 8,
        prompt_logprobs_hits: Callable[[Sequence, int], int] | None = None,
        max_prefix_waits: int = 0,
        policy: str = "fcfs",
    ) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
        self.by_priority = policy == "priority"
        # False: a waiting request waits for a free seat, as in vLLM v1 (benchmarks/priority.py)
        self.preempt_for_seats = True
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras
        self.ensure_adapter = ensure_adapter or (lambda seq, pinned: True)
        self.starvation_steps = starvation_steps
        # (seq, n) -> how many of seq's first n cached blocks also have its prompt logprobs kept.
        self.prompt_logprobs_hits = prompt_logprobs_hits or (lambda seq, n: 0)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        self._blocked_steps: dict[int, int] = {}  # seq_id -> steps spent waiting for an adapter slot
        self.max_prefix_waits = max_prefix_waits
        self._prefix_waits: dict[int, int] = {}  # seq_id -> steps held back for an in-flight block
        self._finished_ids: list[int] = []  # reported by the next schedule
        self._preempted_beams: set[int] = set()  # waiting beams whose siblings may still run

    # ---- queue management ---------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        if self.by_priority:  # (behind any preempted beams moved to the front)
            bisect.insort_right(self.waiting, seq, self._num_beams_first(), key=priority_key)
        else:
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End ``seq`` (any state) and free its blocks at once."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._blocked_steps.pop(seq.seq_id, None)
        self._prefix_waits.pop(seq.seq_id, None)
        seq.status = SeqStatus.FINISHED
        self._finished_ids.append(seq.seq_id)
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.bm.free(seq)
        self.bm.forget(seq)

    def abort(self, request: Request) -> None:
        request.aborted = True
        for seq in request.sequences:
            self.finish(seq, "abort")

    def _inflight_blocks(self) -> dict[bytes, bool]:
        """Hashes of the full prompt blocks running sequences have allocated but not yet committed
        (computed this step or by their next chunks) -> whether their prompt logprobs are kept."""
        out: dict[bytes, bool] = {}
        if not self.bm.enable_prefix_caching:
            return out
        bs = self.bm.block_size
        for s in self.running:
            full = min(len(s.block_table), s.num_prompt_tokens // bs)
            if full <= s.num_cached_blocks:
                continue
            kept = s.request.params.prompt_logprobs is not None
            for h in self.bm.hashes(s, full)[s.num_cached_blocks :]:
                out[h] = out.get(h, False) or kept
        return out

    def _waits_for_sibling(self, seq: Sequence, num_cached: int, inflight: dict[bytes, bool]) -> bool:
        """Hold ``seq`` back this step: its next prompt block is in flight in another sequence (and
        would come with prompt logprobs if it needs them), and it has not waited too long."""
        if not inflight or self._prefix_waits.get(seq.seq_id, 0) >= self.max_prefix_waits:
            return False
        if num_cached >= (seq.num_tokens - 1) // self.bm.block_size:  # no further full block to share
            return False
        h = self.bm.hashes(seq, num_cached + 1)[num_cached]
        if h not in inflight or (seq.request.params.prompt_logprobs is not None and not inflight[h]):
            return False
        self._prefix_waits[seq.seq_id] = self._prefix_waits.get(seq.seq_id, 0) + 1
        self.stats.prefix_waits += 1
        return True

    def _is_starving(self, seq: Sequence) -> bool:
        return self._blocked_steps.get(seq.seq_id, 0) >= self.starvation_steps

    # ---- scheduling -----------------------------------------------------------------------
    @staticmethod
    def drop_drafts(seq: Sequence, keep: int = 0) -> None:
        """Forget ``seq``'s drafted tokens past its first ``keep``."""
        drop = seq.num_draft_tokens - keep
        if drop > 0:
            del seq.token_ids[len(seq.token_ids) - drop :]
            seq.num_draft_tokens = keep

    def _reclaim_drafts(self, out: SchedulerOutput) -> tuple[int, bool]:
        """Take back the drafts of sequences scheduled this step, newest first, until one gives a
        block back: a draft is never worth another sequence's preemption. Returns the tokens taken
        off the step and whether a block came free."""
        back = 0
        for sch in reversed(out.scheduled):
            if not sch.num_drafts:
                continue
            back += sch.num_drafts
            sch.num_new_tokens -= sch.num_drafts
            sch.num_drafts = 0
            self.drop_drafts(sch.seq)
            if self.bm.trim(sch.seq):
                return back, True
        return back, False

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.drop_drafts(seq)
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        if self.by_priority:  # at its place: ahead of later arrivals of its priority
            bisect.insort_left(self.waiting, seq, self._num_beams_first(), key=priority_key)
        else:
            self.waiting.appendleft(seq)
        if seq.request.beam is not None:
            self._preempted_beams.add(seq.seq_id)
        self.stats.num_preemptions += 1
        out.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_seq_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.max_num_batched_tokens
        # Adapters of running sequences hold their slots; new ones may only take free/LRU slots.
        pinned: set[str] = {k for s in self.running if (k := s.request.adapter_key)}

        if self.by_priority and self.preempt_for_seats and self.waiting and self.running:
            self._make_seats(out, pinned)
        preempted_to_admit = len(out.preempted)
        # (a sequence preempted for a seat is not given one back in this step)
        seat_victims = {s.seq_id for s in out.preempted} if preempted_to_admit else set()

        # 1) Running sequences: decodes first (1 token each, oldest first), then the remaining
        #    prefill chunks (oldest first), so a long prompt's chunks never starve decodes.
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        drafted: list[Sequence] = []  # decodes holding drafts (speculative decoding)
        for s in self.running:
            left = len(s.token_ids) - s.num_computed_tokens - s.num_draft_tokens
            if s.ends_pending:  # its last token is in flight and ends it (async scheduling)
                continue
            if left == 1:
                decodes.append(s)
                if s.num_draft_tokens:
                    drafted.append(s)
            elif left > 1:
                prefills.append(s)
        allocate, running, scheduled = self.bm.allocate, SeqStatus.RUNNING, out.scheduled
        bs, refs = self.bm.block_size, self.bm.ref_counts
        if self.by_priority:  # by priority; decodes before prefill chunks within one (merge is stable)
            decodes.sort(key=priority_key)
            prefills.sort(key=priority_key)
            work = list(heapq.merge(decodes, prefills, key=lambda s: s.request.priority))
        else:
            work = decodes + prefills
        for seq in work:
            if budget <= 0:
                break
            if seq.status is not running:
                continue  # preempted earlier in this step
            key = seq.request.adapter_key
            if key is not None and not self.ensure_adapter(seq, pinned - {key}):
                continue
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if num_new == 0:  # a beam waiting for its siblings' proposals: nothing to compute
                continue
            drafts = seq.num_draft_tokens
            if drafts and num_new <= drafts:  # the budget cuts into the drafts: run the ones that fit
                self.drop_drafts(seq, num_new - 1)
                drafts = num_new - 1
            nc, table = seq.num_computed_tokens, seq.block_table
            if nc + num_new <= len(table) * bs and refs[table[nc // bs]] == 1:
                copies = []  # most decode steps: allocate's own first check, inline (256 calls a step)
            else:
                copies = allocate(seq, num_new)
            while copies is None:
                if drafts:  # out of blocks: run without the drafts before preempting anyone
                    self.drop_drafts(seq)
                    num_new -= drafts
                    drafts = 0
                    copies = allocate(seq, num_new)
                    continue
                back, freed = self._reclaim_drafts(out)  # then others' drafts
                budget += back
                if freed:
                    copies = allocate(seq, num_new)
                    continue
                # Out of blocks: preempt the newest running sequence not yet scheduled (possibly
                # ``seq`` itself, which is then the newest such).
                scheduled_ids = {x.seq.seq_id for x in out.scheduled}  # (rare: built when needed)
                if self.by_priority:  # the lowest-priority one (``seq`` is among the candidates)
                    victim = max((s for s in self.running if s.seq_id not in scheduled_ids), key=priority_key)
                else:
                    victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled_ids)
                self._preempt(victim, out)
                if victim is seq:
                    break
                copies = allocate(seq, num_new)
            if copies is None:
                continue
            if copies:
                out.copies.extend(copies)
            sch = ScheduledSeq(seq, seq.num_computed_tokens, num_new)
            if drafts:
                sch.num_drafts = drafts
            scheduled.append(sch)
            budget -= num_new
        if drafted:  # a sequence the step does not run forgets its drafts (a reclaimed one did)
            run = {x.seq.seq_id for x in scheduled if x.num_drafts}
            for s in drafted:
                if s.seq_id not in run:
                    self.drop_drafts(s)

        # 2) Waiting sequences, FIFO. Blocks that don't fit stop admission (FIFO fairness);
        #    an adapter that can't get a slot only holds up its own requests, unless one of
        #    them has starved for `starvation_steps`, then new adapters stop being admitted
        #    until the running ones drain and free a slot.
        #    Nothing new is admitted in a step that had to preempt for blocks (they are short).
        if self._preempted_beams:
            self._beams_first()
        starving = any(n >= self.starvation_steps for n in self._blocked_steps.values())
        seats = sum(_seats(s) for s in self.running) if self.waiting else 0
        inflight = self._inflight_blocks() if self.waiting else {}
        j = 0
        while j < len(self.waiting) and budget > 0 and len(out.preempted) == preempted_to_admit:
            seq = self.waiting[j]
            if seat_victims and seq.seq_id in seat_victims:
                j += 1
                continue
            if seats + _seats(seq) > self.max_num_seqs and self.running:
                break
            key = seq.adapter_key
            if key is not None and key not in pinned:
                fits = len(pinned) < self.max_loras and not (starving and not self._is_starving(seq))
                if not fits or not self.ensure_adapter(seq, set(pinned)):
                    self._blocked_steps[seq.seq_id] = self._blocked_steps.get(seq.seq_id, 0) + 1
                    j += 1
                    continue
            elif (
                key is not None
                and starving
                and not self._is_starving(seq)
                and seq.seq_id not in self._preempted_beams
            ):
                # Let the starving adapter's requests in first: don't grow other adapters' load
                # (base-model requests hold no adapter slot: they go on). A preempted beam goes on:
                # its running siblings wait for it holding the slot, which could never drain.
                j += 1
                continue
            cached = self.bm.lookup(seq)
            if cached and seq.request.params.prompt_logprobs is not None:
                # Prompt logprobs need every prompt position's: a hit counts only as far as the
                # engine kept those positions' logprobs (see engine/prompt_logprobs.py).
                cached = cached[: self.prompt_logprobs_hits(seq, len(cached))]
                if NULL_BLOCK in cached[self.bm._dead_hits(len(cached)) :]:  # a window hit cut inside
                    cached = []  # its evicted early blocks: none to take
            if seq.num_preemptions == 0 and self._waits_for_sibling(seq, len(cached), inflight):
                j += 1
                continue
            num_computed = len(cached) * self.bm.block_size if cached else seq.num_computed_tokens
            num_new = min(seq.num_tokens - num_computed, budget)
            copies = self.bm.allocate(seq, num_new, cached)
            if copies is None:
                break
            del self.waiting[j]
            self._blocked_steps.pop(seq.seq_id, None)
            self._prefix_waits.pop(seq.seq_id, None)
            if self.bm.enable_prefix_caching:  # its prompt blocks are in flight for later arrivals
                kept = seq.request.params.prompt_logprobs is not None
                full = min(len(seq.block_table), seq.num_prompt_tokens // self.bm.block_size)
                for h in self.bm.hashes(seq, full)[seq.num_cached_blocks :]:
                    inflight[h] = inflight.get(h, False) or kept
            if seq.num_preemptions == 0 and seq.index == 0:
                self.stats.prefix_queries += seq.num_tokens
                self.stats.prefix_hits += len(cached) * self.bm.block_size
                seq.request.num_cached_tokens = len(cached) * self.bm.block_size
            if key is not None:
                pinned.add(key)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            seats += _seats(seq)
            out.copies.extend(copies)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
        if not out.scheduled and not out.preempted and self.waiting and self.running:
            self._unstall_beams(out)
        return out

    def _make_seats(self, out: SchedulerOutput, pinned: set[str]) -> None:
        """``policy="priority"``: waiting sequences (in queue order) that are more important than
        some running one and find no free seat preempt the lowest-priority running sequences of
        a strictly lower priority, when those free enough seats (else no one). One whose adapter
        could not get a slot preempts no one. Admission below still reserves each one's adapter
        and blocks, and may hold a seated one back (blocks, budget)."""
        seats = sum(_seats(s) for s in self.running)
        worst = max(s.request.priority for s in self.running)
        held = set(pinned)  # adapters counted against max_loras here (``pinned`` is admission's)
        j = self._num_beams_first()  # (preempted beams ahead of the sorted queue: they neither
        while j < len(self.waiting):  # preempt nor are preempted for seats)
            seq = self.waiting[j]
            j += 1  # (victims are queued behind the sequence they make room for)
            prio, need, key = seq.request.priority, _seats(seq), seq.adapter_key
            if prio >= worst:
                return  # the queue is in priority order: no one after it outranks a running one
            if seq.request.beam is not None:
                continue
            if key is not None and key not in held and len(held) >= self.max_loras:
                continue
            if seats + need > self.max_num_seqs:
                victims = sorted(
                    (s for s in self.running
                     if s.request.priority > prio and s.request.beam is None and not s.ends_pending),
                    key=priority_key, reverse=True,
                )  # fmt: skip
                chosen, freed = [], 0
                for v in victims:
                    if seats - freed + need <= self.max_num_seqs:
                        break
                    chosen.append(v)
                    freed += _seats(v)
                if seats - freed + need > self.max_num_seqs:
                    return  # not enough less important ones for it, nor for any after it
                for v in chosen:
                    self._preempt(v, out)
                    seats -= _seats(v)
                    vkey = v.adapter_key
                    if vkey is not None and all(s.adapter_key != vkey for s in self.running):
                        held.discard(vkey)
                if not self.running:
                    return
                worst = max(s.request.priority for s in self.running)
            seats += need
            if key is not None:
                held.add(key)

    def _num_beams_first(self) -> int:
        """How many preempted beams lead the waiting queue (``_beams_first`` moved them there; the
        queue after them stays sorted under ``policy="priority"``)."""
        n = 0
        if self._preempted_beams:
            for s in self.waiting:
                if s.seq_id not in self._preempted_beams:
                    break
                n += 1
        return n

    def _unstall_beams(self, out: SchedulerOutput) -> None:
        """Every running sequence is a beam waiting for a preempted sibling's proposal, and the
        first such sibling in the queue does not fit in the blocks the waiting beams hold: no step
        would ever run again (two beam searches, each with a beam preempted, can fill the cache so).
        The newest other beam search's running beams (under ``policy="priority"``, the lowest
        priority's) are preempted whole and queued behind the stalled one's, which then runs first;
        the preempted search resumes after it."""
        head = self.waiting[0]
        if head.request.beam is None or head.seq_id not in self._preempted_beams:
            return
        if any(s.request.beam is None or s.num_tokens != s.num_computed_tokens for s in self.running):
            return
        others = [s for s in self.running if s.request is not head.request]
        if not others:  # the stalled search alone holds the cache
            return
        # the newest search's; under policy="priority" the lowest priority's (then the newest)
        victim = (max(others, key=priority_key) if self.by_priority else others[-1]).request
        seqs = [s for s in self.running if s.request is victim]
        for seq in seqs:
            self._preempt(seq, out)
        for seq in seqs:
            self.waiting.remove(seq)
        behind = max(i for i, s in enumerate(self.waiting) if s.request is head.request) + 1
        for k, seq in enumerate(seqs):
            self.waiting.insert(behind + k, seq)

    def _beams_first(self) -> None:
        """Preempted beams go to the front of the queue: their running siblings wait for their
        proposals holding their own blocks, so a queue head that does not fit would stall the
        whole beam search for good (and with it, when the beams hold most of the cache, the engine)."""
        waiting = {s.seq_id for s in self.waiting}
        self._preempted_beams &= waiting
        if not self._preempted_beams:
            return
        first = [s for s in self.waiting if s.seq_id in self._preempted_beams]
        rest = [s for s in self.waiting if s.seq_id not in self._preempted_beams]
        self.waiting = deque(first + rest)

    def update(self, out: SchedulerOutput, *, commit: bool = True) -> None:
        """Account the KV written by this step (before tokens are appended). ``commit=False``
        (async scheduling: the step's inputs may still be placeholders): count the tokens only;
        ``commit`` registers the blocks once every token is known."""
        for s in out.scheduled:
            if s.seq.status is not SeqStatus.RUNNING:
                continue
            # Drafts count once verified (engine.py): a rejected one's KV is garbage to overwrite.
            s.seq.num_computed_tokens = s.start + s.num_new_tokens - s.num_drafts
            if commit:
                self.bm.commit(s.seq)  # before the window releases any of its blocks
                self.bm.release_outside_window(s.seq)

    def commit(self, out: SchedulerOutput) -> None:
        """The prefix-cache registration and window release ``update(out, commit=False)`` left."""
        for s in out.scheduled:
            if s.seq.status is SeqStatus.RUNNING:
                self.bm.commit(s.seq)
                self.bm.release_outside_window(s.seq)

    def add_forked(self, parent: Sequence, child: Sequence) -> None:
        """A sample of ``parent``'s request that shares its blocks (n > 1, beam search)."""
        self.bm.fork(parent, child)
        child.status = SeqStatus.RUNNING
        self.running.append(child)

    def all_sequences(self) -> list[Sequence]:
        return list(self.running) + list(self.waiting)
