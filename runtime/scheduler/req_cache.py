"""Cache bookkeeping per request: take the matched prefix at admission, grow its KV pages, turn planned
checkpoints into tree nodes, and give everything back at the end (`cache_req`), donating the live state
to the tree where it can."""

from __future__ import annotations

from runtime.scheduler.pool import PoolExhausted, UnifiedPool
from runtime.scheduler.radix_cache import HybridRadixCache, MatchResult
from runtime.scheduler.request import Req


class ReqCache:
    def __init__(self, pool: UnifiedPool, cache: HybridRadixCache | None) -> None:
        self.pool = pool
        self.cache = cache
        self.ps = pool.geometry.page_size

    def admit(self, req: Req, match: MatchResult | None) -> bool:
        """Give `req` its live state block (with the matched checkpoint copied in) and its matched pages.
        `match` is a fresh `match_prefix` of the request (None without a radix cache)."""
        try:
            if self.cache is None or match is None:
                req.state = self.pool.alloc_state()
                req.num_computed = req.branch_len = 0
                return True
            self.cache.lock(match.node)
            try:
                req.state = self.cache.alloc_live_state(match)
            except PoolExhausted:
                self.cache.unlock(match.node)
                raise
        except PoolExhausted:
            return False
        req.node = match.node
        req.pages = list(match.pages)
        req.tree_pages = len(match.pages)
        req.num_computed = match.prefix_len
        req.branch_len = match.branch_len
        return True

    def pages_needed(self, req: Req, n: int) -> int:
        """The pages `grow(req, n)` would take."""
        return max(0, -(-(req.num_computed + n) // self.ps) - len(req.pages))

    def grow(self, req: Req, n: int) -> bool:
        """KV pages for `n` more tokens of `req` (all or none); False when the pool cannot make room."""
        need = self.pages_needed(req, n)
        if need == 0:
            return True
        try:
            req.pages.extend(self.pool.alloc_pages(need))
        except PoolExhausted:
            return False
        return True

    def shrink(self, req: Req) -> None:
        """Give back the pages past `req.num_computed` tokens (a verify window's rejected positions)."""
        keep = -(-req.num_computed // self.ps)
        assert keep >= req.tree_pages, f"request {req.rid}: cut back into its tree pages"
        if keep < len(req.pages):
            self.pool.free_pages(req.pages[keep:])
            del req.pages[keep:]

    def alloc_checkpoint(self) -> int | None:
        """A state block for a planned checkpoint; None when there is no room (the checkpoint is skipped)."""
        if self.cache is None:
            return None
        try:
            return self.pool.alloc_state()
        except PoolExhausted:
            return None

    def insert_checkpoint(self, req: Req, pos: int, block: int) -> list[int]:
        """Put the state the worker wrote into `block` (the state after `req`'s first `pos` tokens) into the
        tree with those tokens' KV. Returns the page columns that now hold the tree's page instead of the
        request's duplicate (their entries must be rewritten)."""
        assert self.cache is not None and pos % self.ps == 0 and pos <= req.num_computed
        k = pos // self.ps
        res = self.cache.insert(req.key_ids(0, pos), req.pages[:k], block)
        mine = req.pages[:k]
        # Usually none (its earlier chunks already hold the tree's pages): compared in C, not page by page.
        changed = [i for i, (p, q) in enumerate(zip(mine, res.pages, strict=True)) if p != q] if mine != res.pages \
            else []
        req.pages[:k] = res.pages
        if k >= req.tree_pages:
            req.tree_pages = k
            self.cache.lock(res.node)
            if req.node is not None:
                self.cache.unlock(req.node)
            req.node = res.node
        return changed

    def cache_req(self, req: Req, donate: bool = True) -> None:
        """Return the request's pool memory (it is in no step in flight): donate its live state and KV to
        the tree when its length is page-aligned, else free them."""
        if req.state is None:
            return
        own_from = req.tree_pages
        n = req.num_computed
        if donate and self.cache is not None and n > 0 and n % self.ps == 0:
            k = n // self.ps
            self.cache.insert(req.key_ids(0, n), req.pages[:k], req.state)  # donation
            own_from = k
        else:
            self.pool.free_state(req.state)
        self.pool.free_pages(req.pages[own_from:])
        if req.node is not None:
            assert self.cache is not None
            self.cache.unlock(req.node)
        req.state, req.node, req.pages, req.tree_pages = None, None, [], 0
