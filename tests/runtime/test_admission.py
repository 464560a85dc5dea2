"""Admission accounting: demand of a request, and what fits against what eviction could free."""

from __future__ import annotations

import pytest

from runtime.pool_layout import PoolLayout
from runtime.scheduler.admission import Admission, Demand, request_demand
from runtime.scheduler.pool import PoolExhausted, UnifiedPool
from runtime.scheduler.radix_cache import HybridRadixCache

# 512 B state blocks, 16 B tokens, 4-token pages (64 B): a 4096 B pool is 8 states or 64 pages.
LAYOUT = PoolLayout(num_kda_layers=1, kda_heads=1, head_dim=4, conv_kernel=2, num_mla_layers=1, kv_dim=8,
                    state_dtype="float32", kv_dtype="bfloat16", page_size=4)


def setup() -> tuple[UnifiedPool, HybridRadixCache, Admission]:
    pool = UnifiedPool(LAYOUT, 4096)
    cache = HybridRadixCache(pool)
    return pool, cache, Admission(pool, cache)


def test_request_demand() -> None:
    pool, cache, _ = setup()
    cold = cache.match_prefix(list(range(10)))
    assert request_demand(4, cold, prompt_len=10, max_new_tokens=7) == Demand(5, 2)  # 17 tokens -> 5 pages
    cache.insert(list(range(8)), pool.alloc_pages(2), pool.alloc_state())
    warm = cache.match_prefix(list(range(10)))
    assert warm.prefix_len == 8
    assert request_demand(4, warm, prompt_len=10, max_new_tokens=7) == Demand(3, 2)
    assert request_demand(4, warm, 10, 0, checkpoints_in_flight=0) == Demand(1, 1)
    with pytest.raises(ValueError):
        request_demand(4, warm, 0, 1)


def test_fits_counts_what_eviction_could_free_and_not_what_is_locked() -> None:
    pool, cache, adm = setup()
    for i in range(4):  # 4 cached requests: 4 states and 4 pages, all evictable
        cache.insert([i, 0, 0, 0], pool.alloc_pages(1), pool.alloc_state())
    assert adm.committed() == Demand(0, 0)
    assert adm.fits(Demand(64, 0)) and adm.fits(Demand(0, 8)) and not adm.fits(Demand(1, 8))
    assert not adm.fits(Demand(65, 0)) and not adm.fits(Demand(0, 9))  # the whole pool, no more
    m = cache.match_prefix([0, 0, 0, 0, 9])
    cache.lock(m.node)  # a running request pins its prefix's KV, not the state it copied
    live = cache.alloc_live_state(m)
    assert adm.committed() == Demand(1, 1)
    assert adm.fits(Demand(55, 0)) and not adm.fits(Demand(56, 0))
    # What fits really allocates, evicting as it goes (even the state the request copied).
    got = pool.alloc_pages(55)
    assert len(got) == 55 and (pool.pages_used, pool.states_used) == (56, 1)
    assert adm.fits(Demand(0, 0)) and not adm.fits(Demand(0, 1))
    with pytest.raises(PoolExhausted):
        pool.alloc_state()
    assert not adm.fits(Demand(1, 0)) and cache.reclaimable() == (0, 0)
    cache.check_integrity(held_pages=got, held_states=[live])


def test_reserved_demand_and_over_commitment() -> None:
    pool, _, adm = setup()
    held = [pool.alloc_state() for _ in range(6)]
    assert adm.fits(Demand(8, 1)) and not adm.fits(Demand(8, 1), reserved=Demand(1, 0))
    assert adm.fits(Demand(16, 0)) and not adm.fits(Demand(17, 0))  # 1024 B left: 16 pages or 2 states
    assert adm.fits(Demand(0, 2)) and not adm.fits(Demand(0, 3))
    assert Demand(1, 2).plus(Demand(3, 4)) == Demand(4, 6)
    adm_plain = Admission(pool)
    assert adm_plain.committed() == Demand(0, 6) and len(held) == 6
