"""Admission accounting: what a request needs from the pool (KV pages for its tokens and state blocks)
and whether that fits in what is free plus what evicting the radix cache's unlocked nodes could free.

Both resources come out of one byte range, so the check is not two independent counters: it asks whether
the pages and states in use after the request, less everything evictable, pack into the pool.
Concurrency is therefore capped by states as well as by tokens.
"""

from __future__ import annotations

from typing import NamedTuple

from runtime.scheduler.pool import UnifiedPool
from runtime.scheduler.radix_cache import HybridRadixCache, MatchResult


class Demand(NamedTuple):
    pages: int
    states: int

    def plus(self, other: Demand) -> Demand:
        return Demand(self.pages + other.pages, self.states + other.states)


NO_DEMAND = Demand(0, 0)


def request_demand(page_size: int, match: MatchResult, prompt_len: int, max_new_tokens: int,
                   checkpoints_in_flight: int = 1) -> Demand:
    """Pages and state blocks a request needs on top of its cached prefix: pages for every token past
    `match.prefix_len` up to prompt + max_new_tokens (the last sampled token is never fed back, but its
    page is reserved anyway: it costs at most one page), one live state block, and the checkpoint blocks
    it holds before they enter the tree (one at a time: branching point, chunk ends, decode, end)."""
    if prompt_len < 1 or max_new_tokens < 0:
        raise ValueError(f"bad request sizes: prompt_len={prompt_len}, max_new_tokens={max_new_tokens}")
    total_pages = -(-(prompt_len + max_new_tokens) // page_size)
    return Demand(total_pages - match.prefix_len // page_size, 1 + checkpoints_in_flight)


class Admission:
    """Two-resource admission over one pool and (optionally) its radix cache."""

    def __init__(self, pool: UnifiedPool, cache: HybridRadixCache | None = None) -> None:
        self.pool = pool
        self.cache = cache

    def committed(self) -> Demand:
        """Pages and states that stay in use even if every unlocked cached node is evicted."""
        pages, states = self.pool.pages_used, self.pool.states_used
        if self.cache is not None:
            free = self.cache.reclaimable()
            pages, states = pages - free.pages, states - free.states
        return Demand(pages, states)

    def fits(self, demand: Demand, reserved: Demand = NO_DEMAND) -> bool:
        """Whether `demand` can be allocated (evicting as needed), given `reserved` already promised to
        requests admitted in the same step but not yet allocated."""
        need = self.committed().plus(reserved).plus(demand)
        return self.pool.fits_packed(need.pages, need.states)
