"""Block manager unit tests (torch-free, microseconds each)."""

from __future__ import annotations

import pytest

from lorastar.engine.block_manager import BlockManager
from lorastar.engine.request import Request, Sequence
from lorastar.engine.sampling import SamplingParams

BS = 4

_rid = iter(range(10**9))


def make_seq(tokens: list[int], adapter_key: str | None = None) -> Sequence:
    req = Request(f"r{next(_rid)}", None, list(tokens), SamplingParams(), adapter_key=adapter_key)
    return req.sequences[0]


def compute(bm: BlockManager, seq: Sequence, n: int | None = None, cached: list[int] | None = None) -> list:
    """Allocate for ``n`` more tokens (default: all uncomputed), then account them as written."""
    cached = cached or []
    start = len(cached) * bm.block_size if cached else seq.num_computed_tokens
    if n is None:
        n = seq.num_tokens - start
    copies = bm.allocate(seq, n, cached)
    assert copies is not None
    seq.num_computed_tokens = start + n
    bm.commit(seq)
    return copies


def prefill(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit ``seq`` the way the scheduler does: prefix lookup, then compute the rest."""
    cached = bm.lookup(seq)
    compute(bm, seq, cached=cached)
    return cached


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_allocates_one_block_at_a_time() -> None:
    bm = BlockManager(8, BS)
    seq = make_seq([1, 2, 3])
    assert bm.blocks_needed(seq, 3) == 1
    compute(bm, seq)
    assert len(seq.block_table) == 1 and bm.num_free_blocks == 7
    for tok in (4,):  # fills block 0 exactly: no new block
        seq.token_ids.append(tok)
        compute(bm, seq, 1)
    assert len(seq.block_table) == 1
    seq.token_ids.append(5)
    assert bm.blocks_needed(seq, 1) == 1
    compute(bm, seq, 1)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    for t in range(6, 9):
        seq.token_ids.append(t)
        compute(bm, seq, 1)
    assert len(seq.block_table) == 2
    assert bm.ref_counts[seq.block_table[0]] == 1
    bm.check_invariants([seq])


def test_allocate_fails_without_side_effects() -> None:
    bm = BlockManager(2, BS)
    seq = make_seq(list(range(9)))
    assert not bm.can_allocate(seq, 9)
    assert bm.allocate(seq, 9) is None
    assert seq.block_table == [] and bm.num_free_blocks == 2
    bm.check_invariants([seq])


def test_free_list_reuse_and_refcounts() -> None:
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    a, b = make_seq([1] * 8), make_seq([2] * 8)
    compute(bm, a)
    compute(bm, b)
    assert bm.num_free_blocks == 0
    assert sorted(a.block_table + b.block_table) == [0, 1, 2, 3]
    assert not bm.can_allocate(make_seq([3]), 1)
    freed = list(a.block_table)
    bm.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert bm.num_free_blocks == 2 and all(bm.ref_counts[x] == 0 for x in freed)
    c = make_seq([3] * 8)
    compute(bm, c)
    assert sorted(c.block_table) == sorted(freed)
    bm.check_invariants([b, c])
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 4
    bm.check_invariants([])


def test_double_free_raises_and_changes_nothing() -> None:
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    a = make_seq([1] * 6)
    compute(bm, a)
    own = make_seq([2])
    compute(bm, own)
    impostor = make_seq([1] * 6)
    # No reference taken on a's first block: freeing it after a frees it twice. The impostor's
    # own (validly referenced) block is freed first in tail order, so a partial free would show.
    impostor.block_table = [a.block_table[0], own.block_table[0]]
    bm.free(a)
    bm.ref_counts[own.block_table[0]] += 1  # the impostor's reference to it
    before = list(bm.ref_counts), bm.num_free_blocks
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free(impostor)
    assert (list(bm.ref_counts), bm.num_free_blocks) == before
    assert bm.ref_counts[own.block_table[0]] == 2
    with pytest.raises(RuntimeError, match="disagree"):
        bm.check_invariants([own, impostor])  # the impostor's unreferenced block
    # Freeing an already freed sequence (empty table) is a no-op: preempt-then-finish relies on it.
    bm.free(a)
    bm.ref_counts[own.block_table[0]] -= 1
    bm.check_invariants([own])


def test_check_invariants_detects_corruption() -> None:
    bm = BlockManager(4, BS)
    a = make_seq([1] * 5)
    compute(bm, a)
    bm.check_invariants([a])
    with pytest.raises(RuntimeError, match="disagree"):
        bm.check_invariants([])
    bm.ref_counts[a.block_table[0]] += 1
    with pytest.raises(RuntimeError):
        bm.check_invariants([a])
    bm.ref_counts[a.block_table[0]] -= 1
    bm.check_invariants([a])


def test_usage_and_waste() -> None:
    bm = BlockManager(10, BS)
    a = make_seq([1] * 6)  # 2 blocks, 6 tokens
    compute(bm, a)
    u = bm.usage([a])
    assert (u.block_size, u.num_blocks, u.num_used_blocks, u.num_tokens_stored) == (BS, 10, 2, 6)
    assert u.usage == pytest.approx(0.2)
    assert u.waste == pytest.approx(1 - 6 / 8)
    d = u.as_dict()
    assert d["num_used_blocks"] == 2 and d["usage"] == pytest.approx(0.2)
    bm.free(a)
    u = bm.usage([])
    assert u.num_used_blocks == 0 and u.usage == 0.0 and u.waste == 0.0
    assert u.num_cached_free_blocks == 1  # the one full block keeps its hash


def test_usage_counts_shared_blocks_once() -> None:
    bm = BlockManager(10, BS)
    a = make_seq([1] * 6)
    compute(bm, a)
    b = make_seq([1] * 6)
    bm.fork(a, b)
    u = bm.usage([a, b])
    assert u.num_used_blocks == 2 and u.num_tokens_stored == 6


# ---- prefix cache ---------------------------------------------------------------------------
def test_identical_prompt_hits_full_blocks_only() -> None:
    bm = BlockManager(16, BS)
    a = make_seq(list(range(10)))  # 2 full blocks + 2 tokens
    assert prefill(bm, a) == []
    b = make_seq(list(range(10)))
    hit = prefill(bm, b)
    assert hit == a.block_table[:2]
    assert b.num_cached_blocks >= 2
    assert b.block_table[2] != a.block_table[2]  # the partial block is never shared
    assert all(bm.ref_counts[x] == 2 for x in hit)
    bm.check_invariants([a, b])


def test_never_hits_the_last_token() -> None:
    bm = BlockManager(16, BS)
    a = make_seq(list(range(8)))  # exactly 2 full blocks
    prefill(bm, a)
    b = make_seq(list(range(8)))
    hit = bm.lookup(b)
    assert hit == a.block_table[:1]  # block 1 holds the last token: it must be computed
    compute(bm, b, cached=hit)
    assert b.num_computed_tokens == 8
    # A longer prompt with the same 8-token prefix hits both blocks.
    c = make_seq(list(range(9)))
    assert bm.lookup(c) == a.block_table[:2]
    # A prompt shorter than a block hits nothing.
    assert bm.lookup(make_seq([0, 1, 2])) == []


def test_hash_chain_depends_on_prefix() -> None:
    bm = BlockManager(16, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(bm, a)
    # Same second block content after a different first block: no hit at all.
    b = make_seq([9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert bm.lookup(b) == []
    # Same first block, different second: only the first hits.
    c = make_seq([1, 2, 3, 4, 0, 0, 0, 0, 9])
    assert bm.lookup(c) == a.block_table[:1]


def test_adapter_key_changes_hashes() -> None:
    bm = BlockManager(16, BS)
    prefill(bm, make_seq(list(range(9)), adapter_key="aaa"))
    assert bm.lookup(make_seq(list(range(9)), adapter_key="bbb")) == []
    assert bm.lookup(make_seq(list(range(9)))) == []
    assert len(bm.lookup(make_seq(list(range(9)), adapter_key="aaa"))) == 2


def test_salt_changes_hashes() -> None:
    a, b = BlockManager(16, BS, salt="model-a"), BlockManager(16, BS, salt="model-b")
    s1, s2 = make_seq(list(range(9))), make_seq(list(range(9)))
    a._hashes(s1, 2)
    b._hashes(s2, 2)
    assert a._seq_hashes[s1.seq_id] != b._seq_hashes[s2.seq_id]
    c = BlockManager(16, BS, salt="model-a")
    s3 = make_seq(list(range(9)))
    c._hashes(s3, 2)
    assert c._seq_hashes[s3.seq_id] == a._seq_hashes[s1.seq_id]


def test_disabled_prefix_cache_never_hits() -> None:
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    prefill(bm, make_seq(list(range(9))))
    assert bm.lookup(make_seq(list(range(9)))) == []
    assert bm.usage([]).num_cached_free_blocks == 0


def test_freed_cached_blocks_are_reused_then_lru_evicted() -> None:
    bm = BlockManager(4, BS)
    a = make_seq(list(range(9)))  # 3 blocks, 2 full (cached)
    prefill(bm, a)
    a_full = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4
    # Recently freed content still hits, and taking it back removes it from the free queue.
    b = make_seq(list(range(9)))
    assert prefill(bm, b) == a_full
    assert bm.num_free_blocks == 1
    bm.check_invariants([b])
    bm.free(b)
    # New unrelated content: unhashed free blocks go first, then the LRU cached ones.
    c = make_seq([100] * 5)  # 2 blocks
    compute(bm, c)
    assert bm.lookup(make_seq(list(range(9)))) == a_full  # 2 free blocks were enough
    d = make_seq([200] * 4)
    compute(bm, d)  # evicts one cached block: the tail one first
    assert bm.lookup(make_seq(list(range(9)))) == a_full[:1]
    e = make_seq([300] * 1)
    compute(bm, e)
    assert bm.lookup(make_seq(list(range(9)))) == []
    bm.check_invariants([c, d, e])


def test_lru_order_between_two_prefixes() -> None:
    bm = BlockManager(4, BS)
    old, new = make_seq([1] * 5), make_seq([2] * 5)
    prefill(bm, old)
    prefill(bm, new)
    bm.free(old)
    bm.free(new)  # freed later: more recently used
    x = make_seq([3] * 12)  # needs 3 blocks: 2 unhashed + the LRU cached one
    compute(bm, x)
    assert bm.lookup(make_seq([1] * 5)) == []
    assert len(bm.lookup(make_seq([2] * 5))) == 1


def test_cached_block_shared_while_referenced() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(list(range(6)))
    prefill(bm, a)
    b = make_seq(list(range(6)))
    assert prefill(bm, b) == a.block_table[:1]
    assert bm.ref_counts[a.block_table[0]] == 2
    bm.free(a)
    assert bm.ref_counts[b.block_table[0]] == 1
    assert b.block_table[0] not in bm._free
    bm.check_invariants([b])


def test_admission_with_free_cached_hits_counts_all_blocks() -> None:
    """Bug: can_allocate measured new blocks from token 0, not from the end of the cached prefix,
    so an admission whose hits sit in the free queue passed the check and then crashed
    (KeyError popping an empty free queue)."""
    bm = BlockManager(3, BS)
    a = make_seq(list(range(9)))  # blocks: [0..3] [4..7] [8]
    prefill(bm, a)
    bm.free(a)
    b = make_seq(list(range(9)) + [50, 51, 52, 53])  # 2 hits + 2 new blocks = 4 > 3
    hit = bm.lookup(b)
    assert len(hit) == 2
    num_new = b.num_tokens - 2 * BS
    assert not bm.can_allocate(b, num_new, hit)
    assert bm.allocate(b, num_new, hit) is None
    assert b.block_table == [] and bm.num_free_blocks == 3
    bm.check_invariants([])
    # With one block fewer it fits exactly.
    c = make_seq(list(range(9)) + [50])
    hit = bm.lookup(c)
    assert bm.can_allocate(c, c.num_tokens - 2 * BS, hit)
    compute(bm, c, cached=hit)
    assert len(c.block_table) == 3 and bm.num_free_blocks == 0
    bm.check_invariants([c])


def test_recompute_after_free_hits_own_blocks() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(list(range(6)))
    prefill(bm, a)
    for t in range(6, 11):
        a.token_ids.append(t)
        compute(bm, a, 1)
    n = a.num_tokens
    bm.free(a)  # preemption by recompute
    hit = bm.lookup(a)
    assert len(hit) == (n - 1) // BS
    compute(bm, a, cached=hit)
    assert a.num_computed_tokens == n
    bm.check_invariants([a])


# ---- fork + copy-on-write -------------------------------------------------------------------
def test_fork_and_copy_on_write() -> None:
    bm = BlockManager(16, BS)
    parent = make_seq(list(range(6)))  # 1 full block + a partial one (2 tokens)
    prefill(bm, parent)
    kids = [make_seq(list(range(6))) for _ in range(2)]
    for k in kids:
        bm.fork(parent, k)
    full, partial = parent.block_table
    assert bm.ref_counts[full] == 3 and bm.ref_counts[partial] == 3
    bm.check_invariants([parent, *kids])
    writers = [kids[0], parent, kids[1]]
    copies = []
    for w in writers:
        w.token_ids.append(99)
        copies.append(compute(bm, w, 1))
    # Each writer copies while the block is shared; the last one keeps the original.
    assert copies[0] == [(partial, kids[0].block_table[1])]
    assert copies[1] == [(partial, parent.block_table[1])]
    assert copies[2] == []
    assert kids[1].block_table[1] == partial
    assert len({w.block_table[1] for w in writers}) == 3
    assert bm.ref_counts[full] == 3 and all(bm.ref_counts[w.block_table[1]] == 1 for w in writers)
    # Later writes never copy again.
    for w in writers:
        w.token_ids.append(98)
        assert compute(bm, w, 1) == []
    bm.check_invariants(writers)
    for w in writers:
        bm.free(w)
        bm.forget(w)
    assert bm.num_free_blocks == 16 and sum(bm.ref_counts) == 0
    bm.check_invariants([])


def test_fork_on_block_boundary_needs_no_copy() -> None:
    bm = BlockManager(8, BS)
    parent = make_seq(list(range(8)))
    prefill(bm, parent)
    child = make_seq(list(range(8)))
    bm.fork(parent, child)
    for s in (parent, child):
        s.token_ids.append(7)
        assert compute(bm, s, 1) == []
    assert parent.block_table[:2] == child.block_table[:2]
    assert parent.block_table[2] != child.block_table[2]
    bm.check_invariants([parent, child])


def test_copy_on_write_counts_in_can_allocate() -> None:
    bm = BlockManager(2, BS)
    parent = make_seq(list(range(6)))
    prefill(bm, parent)
    child = make_seq(list(range(6)))
    bm.fork(parent, child)
    assert bm.num_free_blocks == 0
    child.token_ids.append(1)
    assert not bm.can_allocate(child, 1)  # needs a copy of the shared partial block
    assert bm.allocate(child, 1) is None
    bm.check_invariants([parent, child])
    bm.free(parent)
    assert bm.allocate(child, 1) == []  # sole owner now: writes in place
    bm.check_invariants([child])


def test_no_leaks_after_mixed_workload() -> None:
    bm = BlockManager(32, BS)
    seqs = []
    for i in range(6):
        s = make_seq([i % 2] * 7 + [i])
        prefill(bm, s)
        seqs.append(s)
    kid = make_seq(list(seqs[0].token_ids))
    bm.fork(seqs[0], kid)
    seqs.append(kid)
    for step in range(10):
        for s in seqs:
            s.token_ids.append(step)
            compute(bm, s, 1)
        bm.check_invariants(seqs)
    for s in seqs:
        bm.free(s)
        bm.forget(s)
    assert bm.num_free_blocks == 32 and sum(bm.ref_counts) == 0
    assert bm._seq_hashes == {}
    bm.check_invariants([])


def test_lookup_only_at_admission() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(list(range(9)))
    prefill(bm, a)
    b = make_seq(list(range(9)))
    hit = bm.lookup(b)
    compute(bm, b, 1)  # b now holds a block of its own
    assert bm.lookup(b) == []
    with pytest.raises(ValueError, match="admission"):
        bm.allocate(b, 1, hit)
    bm.check_invariants([a, b])


def test_check_invariants_detects_bad_cache_and_overrun() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(list(range(9)))
    prefill(bm, a)
    bm.check_invariants([a])
    a.num_computed_tokens += BS
    with pytest.raises(RuntimeError, match="exceed"):
        bm.check_invariants([a])
    a.num_computed_tokens -= BS
    h = bm.block_hash[a.block_table[0]]
    assert h is not None
    del bm._cached[h]
    with pytest.raises(RuntimeError, match="hash"):
        bm.check_invariants([a])


# ---- sliding window -----------------------------------------------------------------------------


def test_sliding_window_releases_blocks_before_the_window() -> None:
    from lorastar.engine.block_manager import NULL_BLOCK

    bm = BlockManager(32, BS, sliding_window=6)
    seq = make_seq(list(range(10, 40)))  # 30 tokens
    compute(bm, seq, 9)
    # Next query at position 9 sees keys 4..9: block 0 (positions 0..3) is dead, block 1 is not.
    assert bm.release_outside_window(seq) == 1
    assert seq.block_table[0] == NULL_BLOCK and seq.block_table[1] != NULL_BLOCK
    assert bm.release_outside_window(seq) == 0  # idempotent
    bm.check_invariants([seq])
    child = make_seq(list(range(10, 40)))
    bm.fork(seq, child)  # the hole is shared, not referenced
    bm.check_invariants([seq, child])
    compute(bm, seq)  # all 30: next query at 30 sees 25..30
    bm.release_outside_window(seq)
    assert seq.block_table[:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in seq.block_table[6:]
    bm.check_invariants([seq, child])
    held = bm.num_blocks - bm.num_free_blocks
    bm.free(child)
    bm.free(seq)
    bm.check_invariants([])
    assert held > 0 and bm.num_free_blocks == bm.num_blocks
    # The released blocks kept their prefix-cache hashes: the same prompt hits them again.
    again = make_seq(list(range(10, 40)))
    assert len(bm.lookup(again)) == 7


def test_no_release_without_a_uniform_window() -> None:
    bm = BlockManager(32, BS)
    seq = make_seq(list(range(40)))
    compute(bm, seq)
    assert bm.release_outside_window(seq) == 0
    bm.check_invariants([seq])
