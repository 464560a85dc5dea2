"""The two-ended allocator without a cache: ends, holes, meeting, compaction, fixed split, accounting."""

from __future__ import annotations

import random

import pytest

from runtime.pool_layout import CopyCommand, PoolLayout
from runtime.scheduler.pool import Kind, PoolExhausted, UnifiedPool
from tests.runtime.pool_rows import token_rows

# 1 KDA layer of 1x4x4 fp32 (64 B -> one 256 B region) + conv 12x1 bf16 (one 256 B region): 512 B blocks.
LAYOUT = PoolLayout(num_kda_layers=1, kda_heads=1, head_dim=4, conv_kernel=2, num_mla_layers=1, kv_dim=8,
                    state_dtype="float32", kv_dtype="bfloat16", page_size=2)  # 32 B pages


def make(total: int = 4096, **kw: int) -> UnifiedPool:
    pool = UnifiedPool(LAYOUT, total, **kw)
    assert pool.geometry.state_block_bytes == 512 and pool.geometry.page_bytes == 32
    return pool


def test_states_from_the_top_pages_from_the_bottom() -> None:
    pool = make()
    g = pool.geometry
    a, b = pool.alloc_state(), pool.alloc_state()
    assert [pool.state_slot(a), pool.state_slot(b)] == [g.num_state_slots - 1, g.num_state_slots - 2]
    pages = pool.alloc_pages(3)
    assert [pool.page_index(p) for p in pages] == [0, 1, 2]
    assert token_rows(pool, pages, 1, 5) == [1, 2, 3, 4]
    u = pool.usage()
    assert (u.state_blocks, u.kv_pages, u.state_bytes, u.kv_bytes) == (2, 3, 1024, 96)
    assert u.gap_bytes == g.total_bytes - 1024 - 96
    pool.check_integrity()


def test_holes_are_reused_first_and_the_edge_shrinks() -> None:
    pool = make()
    pages = pool.alloc_pages(4)
    pool.free_pages([pages[1]])
    assert pool.usage().kv_holes == 1
    (again,) = pool.alloc_pages(1)
    assert pool.page_index(again) == 1
    pool.free_pages([pages[3], pages[2]])  # freeing the innermost pulls the edge back over the hole behind it
    u = pool.usage()
    assert (u.kv_holes, u.kv_extent_bytes) == (0, 2 * 32)
    s = [pool.alloc_state() for _ in range(3)]
    pool.free_state(s[0])
    t = pool.alloc_state()
    assert pool.state_slot(t) == pool.geometry.num_state_slots - 1
    pool.check_integrity()
    with pytest.raises(KeyError):
        pool.free_state(s[0])
    with pytest.raises(KeyError):
        pool.free_pages([pages[3]])


def test_sides_meet_and_allocation_is_all_or_nothing() -> None:
    pool = make()  # 8 state slots or 128 pages
    states = [pool.alloc_state() for _ in range(6)]  # top 3072 B
    pages = pool.alloc_pages(32)  # bottom 1024 B: the pool is full
    assert pool.usage().gap_bytes == 0
    with pytest.raises(PoolExhausted):
        pool.alloc_state()
    with pytest.raises(PoolExhausted):
        pool.alloc_pages(1)
    before = pool.usage()
    pool.free_pages(pages[:3])  # 3 holes, but 5 pages are asked for: nothing may be taken
    with pytest.raises(PoolExhausted):
        pool.alloc_pages(5)
    assert pool.usage().kv_pages == before.kv_pages - 3
    assert len(pool.alloc_pages(3)) == 3
    pool.check_integrity()
    assert len(states) == 6


def test_a_state_allocation_compacts_the_kv_side() -> None:
    pool = make()
    states = [pool.alloc_state() for _ in range(6)]
    pages = pool.alloc_pages(32)
    pool.drain_copies()
    pool.free_pages(pages[0:16])  # 512 B of holes at the bottom: exactly one state block
    outer = pages[16:]
    old = {p: pool.page_index(p) for p in outer}
    s = pool.alloc_state()
    assert pool.state_slot(s) == pool.geometry.num_state_slots - 7
    copies = pool.drain_copies()
    moved = {p for p in outer if pool.page_index(p) != old[p]}
    assert len(copies) == len(moved) == 16
    for c in copies:
        assert c.nbytes == 32 and c.dst < c.src
    # Each move is one table entry: the page keeps its id and its bytes go where the table now says.
    assert {(old[p] * 32, pool.page_index(p) * 32) for p in moved} == {(c.src, c.dst) for c in copies}
    assert pool.usage().compaction_moves == 16
    pool.check_integrity()
    assert len(states) == 6


def test_a_page_allocation_compacts_the_state_side() -> None:
    pool = make()
    states = [pool.alloc_state() for _ in range(8)]  # the whole pool
    pool.free_state(states[2])
    pool.free_state(states[4])
    pool.drain_copies()
    live = [s for s in states if s not in (states[2], states[4])]
    slot = {s: pool.state_slot(s) for s in live}
    got = pool.alloc_pages(20)  # needs one state block's bytes (16 pages) and then some
    assert len(got) == 20
    copies = pool.drain_copies()
    assert len(copies) == 2 and all(c.nbytes == 512 and c.dst > c.src for c in copies)
    assert {pool.state_slot(s) for s in live} == set(range(2, 8))
    assert slot[states[0]] == pool.state_slot(states[0])  # outermost blocks stay where they are
    pool.check_integrity()


def test_explicit_compaction_and_state_copies() -> None:
    pool = make()
    states = [pool.alloc_state() for _ in range(5)]
    pool.free_state(states[1])
    pool.free_state(states[2])
    pool.drain_copies()
    assert pool.compact(Kind.STATE) == 2
    assert pool.usage().state_holes == 0
    pool.drain_copies()
    pool.copy_state(states[0], states[4])
    g = pool.geometry
    assert pool.drain_copies() == [CopyCommand(g.state_offset(pool.state_slot(states[0])),
                                               g.state_offset(pool.state_slot(states[4])), 512)]
    with pytest.raises(ValueError):
        pool.copy_state(states[0], states[0])


def test_pinned_blocks_are_never_moved() -> None:
    """A block a P/D transfer writes into is pinned: compaction stops at it (an allocation that needs the move then
    finds no room that way), and moves it again once unpinned."""
    pool = make()
    pages = pool.alloc_pages(4)
    states = [pool.alloc_state() for _ in range(3)]
    pool.free_pages(pages[:1])
    pool.free_state(states[0])
    pool.pin(Kind.KV, pages[3:])
    pool.pin(Kind.STATE, states[2:])
    before = (pool.page_index(pages[3]), pool.state_slot(states[2]))
    pool.drain_copies()
    assert pool.compact(Kind.KV) == 0 and pool.compact(Kind.STATE) == 0 and not pool.drain_copies()
    assert (pool.page_index(pages[3]), pool.state_slot(states[2])) == before
    pool.check_integrity()
    pool.unpin(Kind.KV, pages[3:])
    pool.unpin(Kind.STATE, states[2:])
    assert pool.compact(Kind.KV) == 1 and pool.compact(Kind.STATE) == 1
    pool.check_integrity()


def test_fixed_split_keeps_each_side_in_its_half() -> None:
    pool = make(kv_limit_bytes=2048)
    assert len(pool.alloc_pages(64)) == 64
    with pytest.raises(PoolExhausted):
        pool.alloc_pages(1)  # the other half is empty, but it is not the KV side's
    states = [pool.alloc_state() for _ in range(4)]
    with pytest.raises(PoolExhausted):
        pool.alloc_state()
    pool.check_integrity()
    assert pool.fits_packed(64, 4) and not pool.fits_packed(65, 0) and not pool.fits_packed(0, 5)
    assert len(states) == 4


@pytest.mark.parametrize("seed", range(4))
def test_fits_packed_predicts_allocation(seed: int) -> None:
    rng = random.Random(seed)
    pool = make(total=8192 + 256)  # leaves a remainder below the lowest state slot
    held_states: list[int] = []
    held_pages: list[int] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.3:
            n = rng.randint(1, 20)
            expect = pool.fits_packed(pool.pages_used + n, pool.states_used)
            try:
                held_pages += pool.alloc_pages(n)
                assert expect
            except PoolExhausted:
                assert not expect
        elif op < 0.5:
            expect = pool.fits_packed(pool.pages_used, pool.states_used + 1)
            try:
                held_states.append(pool.alloc_state())
                assert expect
            except PoolExhausted:
                assert not expect
        elif op < 0.8 and held_pages:
            for _ in range(rng.randint(1, min(8, len(held_pages)))):
                pool.free_pages([held_pages.pop(rng.randrange(len(held_pages)))])
        elif held_states:
            pool.free_state(held_states.pop(rng.randrange(len(held_states))))
        pool.check_integrity()
        assert pool.live_pages() == set(held_pages) and pool.live_states() == set(held_states)
