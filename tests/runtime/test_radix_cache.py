"""The hybrid radix cache, case by case (the stateful test in test_radix_stateful.py covers the mix)."""

from __future__ import annotations

import pytest

from runtime.pool_layout import PoolLayout
from runtime.scheduler.pool import Kind, PoolExhausted, UnifiedPool
from runtime.scheduler.radix_cache import HybridRadixCache


def layout(page_size: int = 1) -> PoolLayout:
    # 512 B state blocks, 16 B per token.
    return PoolLayout(num_kda_layers=1, kda_heads=1, head_dim=4, conv_kernel=2, num_mla_layers=1, kv_dim=8,
                      state_dtype="float32", kv_dtype="bfloat16", page_size=page_size)


def make(total: int = 16 * 1024, page_size: int = 1) -> HybridRadixCache:
    return HybridRadixCache(UnifiedPool(layout(page_size), total))


def put(cache: HybridRadixCache, tokens: list[int]) -> int:
    """Cache `tokens` as a finished request would: fresh pages and a state, all handed to the tree."""
    pool = cache.pool
    state = pool.alloc_state()
    cache.insert(tokens, pool.alloc_pages(len(tokens) // cache.page_size), state)
    return state


def test_empty_tree_and_the_last_token() -> None:
    cache = make()
    m = cache.match_prefix([1, 2, 3])
    assert (m.pages, m.node, m.state, m.prefix_len, m.branch_len) == ([], cache.root, None, 0, 0)
    s = put(cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4])
    assert (m.prefix_len, m.branch_len) == (0, 3)  # the last prompt token is never matched
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert (m.prefix_len, m.branch_len, m.state) == (4, 4, s)
    assert m.pages == cache.insert([1, 2, 3, 4], m.pages, cache.pool.alloc_state()).pages
    cache.check_integrity(held_pages=[], held_states=[])


def test_branching_point_gets_a_checkpoint_and_duplicates_are_freed() -> None:
    cache = make()
    pool = cache.pool
    s8 = put(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    m = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert (m.state, m.prefix_len, m.branch_len) == (None, 0, 4)
    # The request recomputed tokens 0..3 into its own pages; the checkpoint at the branch splits the edge.
    mine = pool.alloc_pages(6)
    ckpt = pool.alloc_state()
    r = cache.insert([1, 2, 3, 4], mine[:4], ckpt)
    assert r.state_taken and r.freed_pages == 4 and r.node.depth == 4
    assert not any(map(pool.is_page, mine[:4])) and r.pages != mine[:4]
    m = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert (m.state, m.prefix_len, m.branch_len, m.pages) == (ckpt, 4, 4, r.pages)
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert (m.state, m.prefix_len) == (s8, 8)
    cache.check_integrity(held_pages=mine[4:], held_states=[])


def test_donation_moves_ownership() -> None:
    cache = make()
    pool = cache.pool
    live = pool.alloc_state()
    pages = pool.alloc_pages(5)
    before = pool.usage().state_blocks
    r = cache.insert([1, 2, 3, 4, 5], pages, live)
    assert r.state_taken and r.node.state == live and pool.usage().state_blocks == before
    assert pool.drain_copies() == []  # donation copies nothing
    again = pool.alloc_state()
    r2 = cache.insert([1, 2, 3, 4, 5], r.pages, again)
    assert not r2.state_taken and not pool.is_state(again)
    cache.check_integrity(held_pages=[], held_states=[])


def test_tombstones_and_the_leaf_rule() -> None:
    cache = make()
    put(cache, [1, 2, 3, 4, 5, 6])
    put(cache, [1, 2, 3, 7, 7, 7])
    mid = put(cache, [1, 2, 3])
    assert cache.stats().cached_states == 3
    # Oldest first: the first leaf goes entirely (a leaf never becomes a tombstone).
    assert cache.evict(Kind.STATE, 1) == 1
    assert cache.stats().cached_pages == 6
    assert cache.evict(Kind.STATE, 1) == 1  # the second leaf
    assert cache.stats()[:3] == (2, 3, 1)
    # Only [1,2,3] is left, now a leaf with a state; a tombstone-to-be is the inner node of a fresh branch.
    put(cache, [1, 2, 3, 4, 4])
    assert cache.evict(Kind.STATE, 1) == 1  # LRU: [1,2,3]'s state, an internal node now: tombstone
    assert not cache.pool.is_state(mid) and cache.stats().cached_pages == 5
    m = cache.match_prefix([1, 2, 3, 9])
    assert (m.prefix_len, m.branch_len) == (0, 3)  # KV still matches: the caller re-checkpoints there
    assert cache.evict(Kind.KV, 1) == 5  # removing the last leaf takes its stateless parent too
    assert cache.stats()[:3] == (1, 0, 0)
    cache.check_integrity(held_pages=[], held_states=[])


def test_hits_refresh_only_the_consumed_node() -> None:
    cache = make()
    y = put(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    z = put(cache, [5, 5, 5, 5])
    x = put(cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4, 5, 9])  # consumes x; y matched only by KV
    assert (m.state, m.branch_len) == (x, 5)
    order = []
    for _ in range(3):
        before = cache.pool.live_states()
        cache.evict(Kind.STATE, 1)
        order += list(before - cache.pool.live_states())
    assert order == [y, z, x]


def test_locks_protect_kv_but_not_states() -> None:
    cache = make()
    pool = cache.pool
    put(cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4, 5])
    cache.lock(m.node)
    live = cache.alloc_live_state(m)
    assert pool.drain_copies()[0].nbytes == pool.geometry.state_block_bytes  # copy on hit
    assert cache.reclaimable() == (0, 1)
    assert cache.evict(Kind.KV, 4) == 0
    assert cache.evict(Kind.STATE, 1) == 1  # the request copied it already: it may go
    assert cache.stats()[:3] == (2, 4, 0)  # a locked tombstone leaf: its KV is still in use
    cache.check_integrity(held_pages=[], held_states=[live])
    cache.unlock(m.node)  # ... and goes with the last lock
    assert cache.stats()[:3] == (1, 0, 0)
    cache.check_integrity(held_pages=[], held_states=[live])
    with pytest.raises(ValueError):
        cache.unlock(m.node)


def test_live_state_takes_the_checkpoint_over_when_nothing_else_can_go() -> None:
    cache = make(total=2 * 512 + 256)  # two state slots and 16 tokens of KV
    pool = cache.pool
    ckpt = put(cache, [1, 2])
    m = cache.match_prefix([1, 2, 3])
    cache.lock(m.node)
    filler = pool.alloc_state()
    assert pool.states_used == 2 and cache.reclaimable().states == 1
    live = cache.alloc_live_state(m)
    assert live == ckpt and m.node.state is None and pool.drain_copies() == []
    cache.unlock(m.node)
    cache.check_integrity(held_pages=[], held_states=[live, filler])


def test_page_aligned_tree() -> None:
    cache = make(page_size=4)
    pool = cache.pool
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], [pool.alloc_pages(1)[0]], pool.alloc_state())
    put(cache, list(range(12)))
    m = cache.match_prefix([0, 1, 2, 3, 4, 5, 9, 9, 9])
    assert (m.prefix_len, m.branch_len) == (0, 4)  # KV matches whole pages only
    put(cache, [0, 1, 2, 3])
    m = cache.match_prefix(list(range(12)))
    assert (m.prefix_len, m.branch_len, len(m.pages)) == (4, 8, 1)  # 11 usable tokens: two whole pages
    cache.check_integrity()


def test_pool_pressure_evicts_through_the_cache() -> None:
    cache = make(total=8 * 512)  # 8 state slots or 256 tokens
    pool = cache.pool
    for i in range(6):
        put(cache, [i, 1, 2, 3])
    assert cache.stats().cached_states == 6
    # A long run of pages needs the bytes of the cached states: their leaves go, the state side compacts.
    pages = pool.alloc_pages(200)
    assert len(pages) == 200 and cache.stats().cached_states < 6
    states = [pool.alloc_state() for _ in range(1)]
    with pytest.raises(PoolExhausted):
        pool.alloc_pages(100)
    cache.check_integrity(held_pages=pages, held_states=states)


def _fill_pages(pool: UnifiedPool) -> list[int]:
    got: list[int] = []
    while pool.fits_packed(pool.pages_used + 1, pool.states_used):
        got += pool.alloc_pages(1)
    return got


def test_free_bytes_are_used_before_anything_is_evicted() -> None:
    cache = make(total=8 * 512)
    pool = cache.pool
    for i in range(3):
        put(cache, [i, 9])
    held = _fill_pages(pool)
    pool.free_pages(held[:40])  # KV holes worth more than a state block
    s = pool.alloc_state()  # compacts the KV side instead of evicting a cached state
    assert cache.stats().evicted_states == 0 and pool.usage().compaction_moves > 0
    cache.check_integrity(held_pages=held[40:], held_states=[s])


def test_a_kv_allocation_evicts_states_first() -> None:
    cache = make(total=8 * 512)
    pool = cache.pool
    inner = put(cache, [1, 2])  # least recently used state, on what becomes an internal node
    put(cache, [1, 2, 3, 4])
    put(cache, [5, 6])
    held_states = [pool.alloc_state() for _ in range(4)]
    held = _fill_pages(pool)
    got = pool.alloc_pages(1)  # the oldest state goes; its node keeps its KV (a tombstone)
    stats = cache.stats()
    assert not pool.is_state(inner) and (stats.cached_states, stats.cached_pages, stats.evicted_pages) == (2, 6, 0)
    assert pool.usage().compaction_moves > 0
    cache.check_integrity(held_pages=held + got, held_states=held_states)
