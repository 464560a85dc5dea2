"""A Hypothesis state machine over the pool, its bytes and the radix cache, with random layouts and sizes.

Every state block and KV row carries a fingerprint of the token prefix it stands for, written through the
typed views, so compaction, copy on hit, donation and eviction are checked on the bytes: a match must
return the exact state of the matched prefix, every cached node must hold its own path's data, and after
every step the pool holds exactly the tree plus what requests and other users hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from runtime.pool_layout import ALIGN, PoolLayout
from runtime.scheduler.admission import Admission, Demand
from runtime.scheduler.pool import Kind, PoolExhausted, UnifiedPool
from runtime.scheduler.radix_cache import HybridRadixCache, Node
from runtime.worker.pool_buffer import PoolBuffer
from tests.runtime.pool_rows import token_rows

ALPHABET = 3  # few distinct tokens: prompts share prefixes often
MAX_REQS = 4


def fingerprint(key: tuple[object, ...], salt: int) -> int:
    return hash((salt, key)) % (1 << 21)  # exact in fp32 and, 7 bits per column, in bf16


@dataclass
class Req:
    tokens: list[int]
    pages: list[int]  # pages[: node.depth // page_size] belong to the tree, the rest to the request
    live: int
    node: Node


class PoolCacheMachine(RuleBasedStateMachine):
    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        d = data.draw
        lay = PoolLayout(
            num_kda_layers=d(st.integers(1, 2)), kda_heads=d(st.integers(1, 2)), head_dim=d(st.sampled_from([2, 4])),
            conv_kernel=d(st.integers(2, 4)), num_mla_layers=d(st.integers(1, 2)), kv_dim=d(st.integers(3, 6)),
            state_dtype="float32", kv_dtype=d(st.sampled_from(["bfloat16", "float32"])),
            page_size=d(st.sampled_from([1, 2, 4])),
        )
        slots = d(st.integers(4, 12))
        total = slots * lay.state_block_bytes + d(st.integers(0, 4)) * ALIGN
        split = d(st.sampled_from([None, None, None, total // 2]))
        self.lay, self.ps = lay, lay.page_size
        self.pool = UnifiedPool(lay, total, kv_limit_bytes=split)
        self.buf = PoolBuffer(lay, total)
        self.cache = HybridRadixCache(self.pool)
        self.adm = Admission(self.pool, self.cache)
        self.reqs: dict[int, Req] = {}
        self.next_rid = 0
        self.raw_states: list[int] = []
        self.raw_pages: list[int] = []
        self.seen: list[tuple[int, ...]] = [()]

    # --- bytes -----------------------------------------------------------------------------------------
    def sync(self) -> None:
        self.buf.apply_copies(self.pool.drain_copies())

    def write_state(self, vid: int, key: tuple[object, ...]) -> None:
        slot = self.pool.state_slot(vid)
        for layer in range(self.lay.num_kda_layers):
            self.buf.recurrent_state(layer)[slot] = float(fingerprint(key, layer))
            self.buf.conv_state(layer)[slot] = float(fingerprint(key, 100 + layer) % 128)

    def state_is(self, vid: int, key: tuple[object, ...]) -> bool:
        slot = self.pool.state_slot(vid)
        return all(
            bool((self.buf.recurrent_state(layer)[slot] == float(fingerprint(key, layer))).all())
            and bool((self.buf.conv_state(layer)[slot] == float(fingerprint(key, 100 + layer) % 128)).all())
            for layer in range(self.lay.num_kda_layers)
        )

    def _rows(self, keys: list[tuple[object, ...]], layer: int) -> torch.Tensor:
        kv_dim = self.lay.kv_dim
        vals = [[(fingerprint(k, 200 + layer) >> (7 * j)) & 127 for j in range(kv_dim)] for k in keys]
        return torch.tensor(vals, dtype=getattr(torch, self.lay.kv_dtype))

    def write_kv(self, pages: list[int], tokens: list[int], start: int, end: int) -> None:
        if start >= end:
            return
        rows = token_rows(self.pool, pages, start, end)
        keys = [tuple(tokens[: i + 1]) for i in range(start, end)]
        for layer in range(self.lay.num_mla_layers):
            self.buf.kv(layer)[rows] = self._rows(keys, layer)

    def kv_is(self, pages: list[int], tokens: list[int] | tuple[int, ...], start: int, end: int) -> bool:
        if start >= end:
            return True
        rows = token_rows(self.pool, pages, start, end)
        keys = [tuple(tokens[: i + 1]) for i in range(start, end)]
        return all(bool((self.buf.kv(layer)[rows] == self._rows(keys, layer)).all())
                   for layer in range(self.lay.num_mla_layers))

    # --- helpers ---------------------------------------------------------------------------------------
    def draw_tokens(self, data: st.DataObject, min_size: int = 1) -> list[int]:
        cached = [path for node, path in self.paths() if node.state is not None]
        base = data.draw(st.sampled_from(self.seen) | st.sampled_from(cached or self.seen))
        cut = data.draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))  # often extend a whole one
        tail = data.draw(st.lists(st.integers(0, ALPHABET - 1), min_size=min_size, max_size=8))
        return list(base[:cut]) + tail

    def relock(self, req: Req, node: Node) -> None:
        self.cache.lock(node)
        self.cache.unlock(req.node)
        req.node = node

    def adopt(self, req: Req, length: int, pages: list[int]) -> None:
        req.pages[: length // self.ps] = pages

    def paths(self) -> list[tuple[Node, tuple[int, ...]]]:
        out, stack = [], [(self.cache.root, ())]
        while stack:
            node, path = stack.pop()
            out.append((node, path))
            stack.extend((c, path + c.key) for c in node.children.values())
        return out

    def check_match(self, q: list[int]) -> None:
        m = self.cache.match_prefix(q)
        ps = self.ps
        limit = max(0, (len(q) - 1) // ps * ps)
        assert m.prefix_len <= m.branch_len <= limit and m.prefix_len % ps == 0 == m.branch_len % ps
        assert len(m.pages) == m.prefix_len // ps
        # Oracles over every root path: the deepest usable state, and how far KV reaches.
        best = kv = 0
        for node, path in self.paths():
            if node.state is not None and len(path) <= limit and tuple(q[: len(path)]) == path:
                best = max(best, len(path))
            n = 0
            while n < min(len(path), limit) and path[n] == q[n]:
                n += 1
            kv = max(kv, n - n % ps)
        assert (m.prefix_len, m.branch_len) == (best, kv)
        if m.state is not None:
            assert self.state_is(m.state, tuple(q[: m.prefix_len])), "match returned another prefix's state"
        assert self.kv_is(m.pages, q, 0, m.prefix_len)

    # --- requests --------------------------------------------------------------------------------------
    @precondition(lambda self: len(self.reqs) < MAX_REQS)
    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        prompt = self.draw_tokens(data)
        self.check_match(prompt)
        m = self.cache.match_prefix(prompt)
        self.cache.lock(m.node)
        new = -(-len(prompt) // self.ps) - len(m.pages)
        branch = m.branch_len > m.prefix_len
        if not self.adm.fits(Demand(new, 1 + branch)):
            self.cache.unlock(m.node)
            return
        # Admitted: nothing below may fail. Allocate everything first, then copy, then "compute".
        live = self.cache.alloc_live_state(m)
        pages = m.pages + self.pool.alloc_pages(new)
        ckpt = self.pool.alloc_state() if branch else None
        self.sync()
        if m.state is not None:
            assert self.state_is(live, tuple(prompt[: m.prefix_len])), "copy on hit lost the checkpoint"
        self.write_kv(pages, prompt, m.prefix_len, len(prompt))
        req = Req(prompt, pages, live, m.node)
        if ckpt is not None:
            self.write_state(ckpt, tuple(prompt[: m.branch_len]))
            r = self.cache.insert(prompt[: m.branch_len], pages[: m.branch_len // self.ps], ckpt)
            self.adopt(req, m.branch_len, r.pages)
            self.relock(req, r.node)
        self.write_state(live, tuple(prompt))
        self.reqs[self.next_rid] = req
        self.next_rid += 1
        self.seen.append(tuple(prompt))

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data(), n=st.integers(1, 6), checkpoint=st.booleans())
    def decode(self, data: st.DataObject, n: int, checkpoint: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs[rid]
        tokens = req.tokens + data.draw(st.lists(st.integers(0, ALPHABET - 1), min_size=n, max_size=n))
        need = -(-len(tokens) // self.ps) - len(req.pages)
        fits = self.adm.fits(Demand(need, 0))
        try:
            req.pages += self.pool.alloc_pages(need)
        except PoolExhausted:
            assert not fits, "admission said the pages fit"
            self.end(rid, donate=False)
            return
        assert fits, "admission said the pages do not fit, but they did"
        self.sync()
        self.write_kv(req.pages, tokens, len(req.tokens), len(tokens))
        req.tokens = tokens
        self.write_state(req.live, tuple(tokens))
        self.seen.append(tuple(tokens))
        if not checkpoint or len(tokens) % self.ps:
            return
        fits = self.adm.fits(Demand(0, 1))
        try:
            ckpt = self.pool.alloc_state()
        except PoolExhausted:
            assert not fits
            return
        assert fits
        self.pool.copy_state(req.live, ckpt)  # a decode checkpoint is a copy of the live state
        self.sync()
        assert self.state_is(ckpt, tuple(tokens))
        r = self.cache.insert(tokens, req.pages, ckpt)
        self.adopt(req, len(tokens), r.pages)
        self.relock(req, r.node)

    def end(self, rid: int, donate: bool) -> None:
        req = self.reqs.pop(rid)
        if donate:
            # Decode up to the page boundary (the last page has room): only whole pages enter the tree.
            pad = -len(req.tokens) % self.ps
            tokens = req.tokens + [0] * pad
            self.write_kv(req.pages, tokens, len(req.tokens), len(tokens))
            req.tokens = tokens
            self.write_state(req.live, tuple(tokens))
            r = self.cache.insert(req.tokens, req.pages, req.live)  # the live block moves to the tree
            if r.state_taken:
                assert self.state_is(r.node.state, tuple(req.tokens))
        else:
            self.pool.free_pages(req.pages[req.node.depth // self.ps :])
            self.pool.free_state(req.live)
        self.cache.unlock(req.node)

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data(), donate=st.booleans())
    def finish(self, data: st.DataObject, donate: bool) -> None:
        self.end(data.draw(st.sampled_from(sorted(self.reqs))), donate)

    # --- the cache and the pool directly ---------------------------------------------------------------
    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        self.check_match(self.draw_tokens(data, min_size=0))

    @rule(kind=st.sampled_from(Kind), units=st.integers(1, 4))
    def evict(self, kind: Kind, units: int) -> None:
        before = self.pool.usage()
        freed = self.cache.evict(kind, units)
        after = self.pool.usage()
        if kind is Kind.STATE:
            assert before.state_blocks - after.state_blocks == freed
        else:
            assert before.kv_pages - after.kv_pages == freed

    @rule(kind=st.sampled_from(Kind))
    def compact(self, kind: Kind) -> None:
        self.pool.compact(kind)
        self.sync()
        assert (self.pool.usage().state_holes if kind is Kind.STATE else self.pool.usage().kv_holes) == 0

    @precondition(lambda self: len(self.raw_pages) < 16)
    @rule(n=st.integers(1, 8))
    def alloc_raw_pages(self, n: int) -> None:
        fits = self.adm.fits(Demand(n, 0))
        try:
            got = self.pool.alloc_pages(n)
        except PoolExhausted:
            assert not fits
            return
        assert fits
        self.sync()
        self.raw_pages += got
        for p in got:
            self.write_kv([p], [-p - 1] * self.ps, 0, self.ps)

    @precondition(lambda self: len(self.raw_states) < 2)
    @rule()
    def alloc_raw_state(self) -> None:
        fits = self.adm.fits(Demand(0, 1))
        try:
            s = self.pool.alloc_state()
        except PoolExhausted:
            assert not fits
            return
        assert fits
        self.sync()
        self.raw_states.append(s)
        self.write_state(s, ("raw", s))

    @precondition(lambda self: bool(self.raw_pages or self.raw_states))
    @rule(data=st.data())
    def free_raw(self, data: st.DataObject) -> None:
        pick = data.draw(st.sampled_from([("p", p) for p in self.raw_pages] + [("s", s) for s in self.raw_states]))
        if pick[0] == "p":
            self.raw_pages.remove(pick[1])
            self.pool.free_pages([pick[1]])
        else:
            self.raw_states.remove(pick[1])
            self.pool.free_state(pick[1])

    # --- after every step ------------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        assert not self.pool.drain_copies(), "a step left copies unapplied"
        held_pages = [p for r in self.reqs.values() for p in r.pages[r.node.depth // self.ps :]]
        held_states = [r.live for r in self.reqs.values()]
        self.cache.check_integrity(held_pages=held_pages + self.raw_pages,
                                   held_states=held_states + self.raw_states)
        for r in self.reqs.values():
            assert self.state_is(r.live, tuple(r.tokens)) and self.kv_is(r.pages, r.tokens, 0, len(r.tokens))
        for node, path in self.paths():
            if node.state is not None:
                assert self.state_is(node.state, path), f"node {node.uid} holds another prefix's state"
            start = len(path) - len(node.key)
            assert self.kv_is([0] * (start // self.ps) + node.pages, path, start, len(path))
        for s in self.raw_states:
            assert self.state_is(s, ("raw", s))
        for p in self.raw_pages:
            assert self.kv_is([p], [-p - 1] * self.ps, 0, self.ps)


PoolCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, derandomize=True, database=None, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_pool_and_cache = PoolCacheMachine.TestCase
