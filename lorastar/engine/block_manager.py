"""Paged KV cache bookkeeping (torch-free): fixed-size blocks, a free queue, reference counts,
per-sequence block tables, copy-on-write, and the automatic prefix cache.

Prefix cache: a *full* block is named by a hash chain over its tokens, the previous block's
hash, the adapter's content hash and an engine salt (model + KV dtype), so only blocks whose
KV is bit-for-bit reusable can match. Unreferenced blocks stay in the free queue with their
hash (LRU: reused from the front) until their space is needed.

Sliding windows: when every layer attends through the same window ``W`` (Mistral), a block whose
last position is before the next query's window (``(i + 1) * BS <= computed - W + 1``) is never read
again; ``release_outside_window`` gives it back and leaves ``NULL_BLOCK`` in its table entry, so a
sequence holds at most ``ceil((W + chunk) / BS) + 1`` blocks however long it grows (prefix-cache hits
before the first query's window are not taken either: ``NULL_BLOCK`` too). Models that mix
windowed and full layers (Gemma 2/3) keep every block: one block table serves all layers, and the
full layers read them all (``benchmarks/kv_memory.py`` measures the memory the local layers waste).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from lorastar.engine.request import Sequence

NULL_BLOCK = -1  # a block-table entry released by the sliding window (never read by attention)


@dataclass
class KVCacheUsage:
    block_size: int
    num_blocks: int
    num_used_blocks: int
    num_tokens_stored: int
    num_cached_free_blocks: int

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def waste(self) -> float:
        cap = self.num_used_blocks * self.block_size
        return 1.0 - self.num_tokens_stored / cap if cap else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "num_used_blocks": self.num_used_blocks,
            "num_tokens_stored": self.num_tokens_stored,
            "num_cached_free_blocks": self.num_cached_free_blocks,
            "usage": self.usage,
            "waste": self.waste,
        }


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        salt: str = "",
        sliding_window: int = 0,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # every layer's window (0: some layer attends fully)
        self._salt = hashlib.blake2b(salt.encode(), digest_size=16).digest()
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Blocks with ref 0, in reuse order (front first). Cached ones go to the back when freed.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._seq_hashes: dict[int, list[bytes]] = {}

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    # ---- prefix cache ---------------------------------------------------------------------
    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        key = (seq.adapter_key or "").encode()
        extra = struct.pack("<I", len(key)) + key  # length-prefixed: no key/token ambiguity
        while len(hashes) < num_blocks:
            i = len(hashes)
            toks = seq.token_ids[i * bs : (i + 1) * bs]
            h = hashlib.blake2b(digest_size=16)
            h.update(hashes[-1] if hashes else self._salt)
            if not hashes and (cache_salt := seq.request.params.cache_salt):
                # The request's own salt, in its first block (every later block chains from it):
                # only requests with the same salt share blocks. The tag keeps it apart from the
                # adapter key's 4-byte length that follows unsalted model salts.
                salt = cache_salt.encode()
                h.update(b"\xffSALT" + struct.pack("<I", len(salt)) + salt)
            h.update(extra)
            h.update(struct.pack(f"<{len(toks)}q", *toks))
            hashes.append(h.digest())
        return hashes

    def hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The prefix-cache keys of ``seq``'s first ``num_blocks`` full blocks (each one hashes
        the model salt, the request's ``cache_salt`` if any, the adapter and every token up to the
        block's end)."""
        return self._hashes(seq, num_blocks)[:num_blocks]

    def lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks for the longest prefix of ``seq`` (never its last token: that one must be
        computed to produce logits)."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        found: list[int] = []
        if self.sliding_window > 0:
            # Every layer slides: a hit of k blocks reads only those from _dead_hits(k) on, so only
            # they must be cached (vLLM's SlidingWindowManager). The early blocks, released first,
            # are the first evicted: requiring them lost every hit of a long prompt. Dead entries
            # are NULL_BLOCK (allocate skips them).
            bids = [self._cached.get(h) for h in self.hashes(seq, max_blocks)]
            run = [0] * (len(bids) + 1)  # run[k]: cached blocks in a row ending at block k - 1
            for k, bid in enumerate(bids, 1):
                run[k] = run[k - 1] + 1 if bid is not None else 0
            for k in range(len(bids), 0, -1):
                dead = self._dead_hits(k)
                if run[k] >= k - dead:
                    return [NULL_BLOCK] * dead + bids[dead:k]  # type: ignore[list-item]
            return found
        # (sliced: the memoised chain may already cover the whole prompt, e.g. hashed at admission
        # before a preemption mid-prefill; a hit on the last token's block would skip its logits)
        for h in self.hashes(seq, max_blocks):
            bid = self._cached.get(h)
            if bid is None:
                break
            found.append(bid)
        return found

    def commit(self, seq: Sequence) -> None:
        """Register ``seq``'s newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_cached_blocks:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_cached_blocks, full):
            bid = seq.block_table[i]
            h = hashes[i]
            if bid != NULL_BLOCK and self.block_hash[bid] is None and h not in self._cached:
                self.block_hash[bid] = h
                self._cached[h] = bid
        seq.num_cached_blocks = full

    # ---- allocation -----------------------------------------------------------------------
    def _take_free(self) -> int:
        bid, _ = self._free.popitem(last=False)
        h = self.block_hash[bid]
        if h is not None:  # evict the cached content this block held
            self.block_hash[bid] = None
            if self._cached.get(h) == bid:
                del self._cached[h]
        self.ref_counts[bid] = 1
        return bid

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:  # type: ignore[assignment]
        if cached:
            # Admission with prefix hits: the new tokens start after the cached blocks.
            total = -(-(len(cached) * self.block_size + num_new_tokens) // self.block_size)
            live = cached[self._dead_hits(len(cached)) :]
            need = total - len(cached) + sum(1 for b in live if self.ref_counts[b] == 0)
        else:
            need = self.blocks_needed(seq, num_new_tokens) + self._cow_needed(seq)
        return need <= len(self._free)

    def _dead_hits(self, num_cached: int) -> int:
        """How many of ``num_cached`` leading hits lie before the sliding window of the first query
        (at position ``num_cached * block_size``): never read, so not taken (``release_outside_window``'s
        rule). Taking them could need more blocks than the cache has: the request never ran."""
        w = self.sliding_window
        return max(0, num_cached * self.block_size - w + 1) // self.block_size if w > 0 else 0

    def _cow_needed(self, seq: Sequence) -> int:
        i = seq.num_computed_tokens // self.block_size
        if i < len(seq.block_table) and self.ref_counts[seq.block_table[i]] > 1:
            return 1
        return 0

    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached: list[int] = (),  # type: ignore[assignment]
    ) -> list[tuple[int, int]] | None:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens. ``cached`` are prefix-cache hits
        from ``lookup`` (only at admission). Returns the copy-on-write copies to perform
        ``[(src, dst)]``, or ``None`` (nothing changed) if the blocks don't fit."""
        if cached and seq.block_table:
            raise ValueError("prefix-cache hits are only taken at admission (empty block table)")
        if not cached and not self.blocks_needed(seq, num_new_tokens) and not self._cow_needed(seq):
            return []  # most decode steps: the tokens fit the blocks held, none of them shared
        if not self.can_allocate(seq, num_new_tokens, cached):
            return None
        dead = self._dead_hits(len(cached)) if cached else 0
        seq.block_table.extend([NULL_BLOCK] * dead)
        for b in cached[dead:]:
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1
            seq.block_table.append(b)
        if cached:
            seq.num_cached_blocks = len(cached)
            seq.num_computed_tokens = len(cached) * self.block_size
        copies: list[tuple[int, int]] = []
        i = seq.num_computed_tokens // self.block_size
        if i < len(seq.block_table) and self.ref_counts[seq.block_table[i]] > 1:
            # The block we are about to write into is shared (forked sample): copy it first.
            src = seq.block_table[i]
            dst = self._take_free()
            self.ref_counts[src] -= 1
            seq.block_table[i] = dst
            seq.block_table_synced = min(seq.block_table_synced, i)
            copies.append((src, dst))
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_free())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s blocks (copy-on-write on its first write)."""
        for b in parent.block_table:
            if b != NULL_BLOCK:
                self.ref_counts[b] += 1
        child.block_table = list(parent.block_table)
        child.block_table_synced = 0
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_blocks = parent.num_cached_blocks
        if parent.seq_id in self._seq_hashes:
            self._seq_hashes[child.seq_id] = list(self._seq_hashes[parent.seq_id])

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; freed blocks that hold cached content stay reusable."""
        # Check before changing anything: a double free leaves the state as it was.
        drops: dict[int, int] = {}
        for b in seq.block_table:
            if b != NULL_BLOCK:
                drops[b] = drops.get(b, 0) + 1
        for b, k in drops.items():
            if self.ref_counts[b] < k:
                raise RuntimeError(f"block {b} freed twice (seq {seq.seq_id})")
        # Tail first: a later allocation then evicts suffix blocks before the shared prefix.
        for b in reversed(seq.block_table):
            if b != NULL_BLOCK:
                self._unref(b)
        seq.block_table = []
        seq.block_table_synced = 0
        seq.num_cached_blocks = 0
        seq.num_computed_tokens = 0

    def trim(self, seq: Sequence) -> int:
        """Give back ``seq``'s trailing blocks past its tokens (taken for drafts that were rejected:
        unshared, never hashed); returns how many."""
        keep = -(-seq.num_tokens // self.block_size)
        table = seq.block_table
        n = len(table) - keep
        if n <= 0:
            return 0
        for _ in range(n):
            self._unref(table.pop())
        seq.block_table_synced = min(seq.block_table_synced, keep - 1)  # the runner's row shrinks too
        return n

    def _unref(self, b: int) -> None:
        rc = self.ref_counts[b] - 1
        self.ref_counts[b] = rc
        if rc == 0:
            self._free[b] = None
            if self.block_hash[b] is None:
                self._free.move_to_end(b, last=False)

    def release_outside_window(self, seq: Sequence) -> int:
        """Give back ``seq``'s blocks that no future query can see (every layer's window has moved
        past them); returns how many entries became ``NULL_BLOCK``. A no-op without a uniform window.
        Cached content stays reusable as a prefix until its space is needed."""
        w = self.sliding_window
        if w <= 0:
            return 0
        # The next query sits at position num_computed_tokens and sees keys from computed - w + 1.
        dead = min(max(0, seq.num_computed_tokens - w + 1) // self.block_size, len(seq.block_table))
        released = 0
        for i in range(dead - 1, -1, -1):  # newest first; stop at the entries released before
            b = seq.block_table[i]
            if b == NULL_BLOCK:
                break
            seq.block_table[i] = NULL_BLOCK
            seq.block_table_synced = min(seq.block_table_synced, i)
            self._unref(b)
            released += 1
        return released

    def forget(self, seq: Sequence) -> None:
        """Drop the hash chain kept for a finished sequence."""
        self._seq_hashes.pop(seq.seq_id, None)

    # ---- introspection --------------------------------------------------------------------
    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by some sequence (O(1): what counters read every step)."""
        return self.num_blocks - len(self._free)

    def usage(self, seqs: list[Sequence]) -> KVCacheUsage:
        """The full picture, O(free blocks + held blocks): tokens stored, cached free blocks."""
        fill: dict[int, int] = {}
        for s in seqs:
            for i, b in enumerate(s.block_table):
                if b == NULL_BLOCK:
                    continue
                n = min(self.block_size, max(0, s.num_computed_tokens - i * self.block_size))
                fill[b] = max(fill.get(b, 0), n)
        used = self.num_used_blocks
        cached_free = sum(1 for b in self._free if self.block_hash[b] is not None)
        return KVCacheUsage(self.block_size, self.num_blocks, used, sum(fill.values()), cached_free)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block's hash, so no later lookup hits. Only when no block is in use
        (False otherwise, nothing forgotten): a running sequence's blocks are still being computed
        or read, and the hashes it registers as it goes would outlive the reset."""
        if any(self.ref_counts):
            return False
        self._cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True

    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Raise if reference counts disagree with the block tables (tests call this)."""
        expected = [0] * self.num_blocks
        for s in seqs:
            for i, b in enumerate(s.block_table):
                if b != NULL_BLOCK:
                    expected[b] += 1
                elif (
                    self.sliding_window <= 0
                    or (i + 1) * self.block_size > s.num_computed_tokens - self.sliding_window + 1
                ):
                    raise RuntimeError(f"seq {s.seq_id}: block {i} released while still inside the window")
        if expected != self.ref_counts:
            bad = [i for i in range(self.num_blocks) if expected[i] != self.ref_counts[i]][:8]
            raise RuntimeError(f"block refcounts disagree with block tables at blocks {bad}")
        free = set(self._free)
        for i in range(self.num_blocks):
            if (self.ref_counts[i] == 0) != (i in free):
                raise RuntimeError(f"block {i}: refcount {self.ref_counts[i]} but free={i in free}")
        for h, b in self._cached.items():
            if self.block_hash[b] != h:
                raise RuntimeError(f"prefix cache entry points at block {b} holding other content")
        for b, h in enumerate(self.block_hash):
            if h is not None and self._cached.get(h) != b:
                raise RuntimeError(f"block {b} holds a hash the prefix cache does not map to it")
        for s in seqs:
            if s.num_computed_tokens > len(s.block_table) * self.block_size:
                raise RuntimeError(
                    f"seq {s.seq_id}: {s.num_computed_tokens} computed tokens exceed its blocks"
                )
