"""Pool pressure: many short chats (states dominate) and a few long documents (KV dominates) both run in
one unified pool, where a fixed 50/50 split of the same bytes fails them; and one pool serves them in
turn, moving its boundary by eviction and compaction."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from runtime.pool_layout import PoolLayout
from runtime.scheduler.pool import PoolExhausted, UnifiedPool
from runtime.scheduler.radix_cache import HybridRadixCache, Node
from runtime.worker.pool_buffer import PoolBuffer

# 2 KDA layers -> 2048 B state blocks; 1 MLA layer of 8 bf16 -> 16 B tokens, 4-token pages.
LAYOUT = PoolLayout(num_kda_layers=2, kda_heads=2, head_dim=8, conv_kernel=4, num_mla_layers=1, kv_dim=8,
                    state_dtype="float32", kv_dtype="bfloat16", page_size=4)
TOTAL = 64 * 1024  # 32 state blocks, or 4096 tokens of KV
PS = LAYOUT.page_size


@dataclass
class Req:
    tokens: list[int]
    pages: list[int]
    live: int
    node: Node
    computed: int = 0


class Engine:
    """The scheduler's use of the cache in miniature: match, copy on hit, chunked prefill with
    checkpoints, decode, donation at the end. Live states carry a fingerprint of their prefix."""

    def __init__(self, pool: UnifiedPool) -> None:
        self.pool = pool
        self.cache = HybridRadixCache(pool)
        self.buf = PoolBuffer(pool.layout, pool.geometry.total_bytes)
        self.running: list[Req] = []
        self.peak_running = 0

    def _stamp(self, vid: int, tokens: list[int]) -> None:
        self.buf.recurrent_state(0)[self.pool.state_slot(vid)] = float(hash(tuple(tokens)) % (1 << 20))

    def _stamped(self, vid: int, tokens: list[int]) -> bool:
        slot = self.pool.state_slot(vid)
        return bool((self.buf.recurrent_state(0)[slot] == float(hash(tuple(tokens)) % (1 << 20))).all())

    def _sync(self) -> None:
        self.buf.apply_copies(self.pool.drain_copies())

    def _relock(self, req: Req, node: Node) -> None:
        self.cache.lock(node)
        self.cache.unlock(req.node)
        req.node = node

    def _checkpoint(self, req: Req, length: int) -> None:
        ckpt = self.pool.alloc_state()
        self._sync()
        self._stamp(ckpt, req.tokens[:length])
        r = self.cache.insert(req.tokens[:length], req.pages[: length // PS], ckpt)
        req.pages[: length // PS] = r.pages
        self._relock(req, r.node)

    def start(self, prompt: list[int], chunk: int) -> Req:
        m = self.cache.match_prefix(prompt)
        self.cache.lock(m.node)
        live = self.cache.alloc_live_state(m)
        self._sync()
        if m.state is not None:
            assert self._stamped(live, prompt[: m.prefix_len])
        req = Req(list(prompt), list(m.pages), live, m.node, computed=len(prompt) - m.prefix_len)
        stops = sorted({m.branch_len} | set(range(m.prefix_len + chunk, len(prompt), chunk)) | {len(prompt)})
        done = m.prefix_len
        for stop in stops:
            if stop <= done:
                continue
            req.pages += self.pool.alloc_pages(-(-stop // PS) - len(req.pages))  # one prefill chunk
            done = stop
            if stop % PS == 0 and stop > req.node.depth:
                self._checkpoint(req, stop)
        self._sync()
        self._stamp(live, prompt)
        self.running.append(req)
        self.peak_running = max(self.peak_running, len(self.running))
        return req

    def decode(self, req: Req, token: int) -> None:
        req.tokens.append(token)
        req.pages += self.pool.alloc_pages(-(-len(req.tokens) // PS) - len(req.pages))
        self._sync()
        self._stamp(req.live, req.tokens)

    def finish(self, req: Req) -> None:
        assert len(req.tokens) % PS == 0  # the workloads end on page boundaries: only whole pages are cached
        assert self._stamped(req.live, req.tokens)
        self.cache.insert(req.tokens, req.pages, req.live)  # donation
        self.cache.unlock(req.node)
        self.running.remove(req)

    def check(self) -> None:
        held_pages = [p for r in self.running for p in r.pages[r.node.depth // PS :]]
        self.cache.check_integrity(held_pages=held_pages, held_states=[r.live for r in self.running])


def short_chats(engine: Engine, chats: int = 20, turns: int = 3, seed: int = 0) -> int:
    """`chats` users at once, each turn = previous turn + 8 new tokens, answered with 8 tokens."""
    rng = random.Random(seed)
    history = [[1000 + c] for c in range(chats)]
    computed = 0
    for turn in range(turns):
        new = 8 - (turn == 0)  # the first turn's prompt starts with the chat's id token
        reqs = [engine.start(h + [rng.randrange(50) for _ in range(new)], chunk=64) for h in history]
        for _ in range(8):
            for r in reqs:
                engine.decode(r, rng.randrange(50))
            engine.check()
        computed += sum(r.computed for r in reqs)
        for c, r in enumerate(reqs):
            history[c] = list(r.tokens)
            engine.finish(r)
        engine.check()
    return computed


def long_documents(engine: Engine, docs: int = 2, length: int = 1400, seed: int = 1) -> int:
    """`docs` long prompts at once (chunked prefill, 256-token chunks), each answered with 32 tokens."""
    rng = random.Random(seed)
    reqs = [engine.start([2000 + d] + [rng.randrange(50) for _ in range(length - 1)], chunk=256)
            for d in range(docs)]
    engine.check()
    for _ in range(32):
        for r in reqs:
            engine.decode(r, rng.randrange(50))
    engine.check()
    for r in reqs:
        engine.finish(r)
    engine.check()
    return sum(r.computed for r in reqs)


WORKLOADS = {"short_chats": short_chats, "long_documents": long_documents}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_unified_pool_runs_each_workload(name: str) -> None:
    pool = UnifiedPool(LAYOUT, TOTAL)
    engine = Engine(pool)
    WORKLOADS[name](engine)
    u = pool.usage()
    if name == "short_chats":
        assert engine.peak_running == 20 and u.peak_state_bytes > TOTAL // 2  # states took most of it
    else:
        assert u.peak_kv_bytes > TOTAL // 2  # KV took most of it
    assert not engine.running


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_a_fixed_half_split_fails_each_workload(name: str) -> None:
    engine = Engine(UnifiedPool(LAYOUT, TOTAL, kv_limit_bytes=TOTAL // 2))
    with pytest.raises(PoolExhausted):
        WORKLOADS[name](engine)


def test_one_pool_serves_both_in_turn() -> None:
    pool = UnifiedPool(LAYOUT, TOTAL)
    engine = Engine(pool)
    first = short_chats(engine)
    long_documents(engine)  # the cached chats' states and KV make way for the documents' KV
    stats = engine.cache.stats()
    assert stats.evicted_states > 0 and pool.usage().compaction_moves > 0
    again = short_chats(engine, seed=0)  # the same chats again: whatever survived still hits
    assert again <= first
    short_chats(engine, seed=5)
    engine.check()
    # Multi-turn hits exactly: after its first turn a chat computes only its 8 new tokens.
    fresh = Engine(UnifiedPool(LAYOUT, TOTAL))
    computed = short_chats(fresh, chats=4, turns=3, seed=9)
    assert computed == 3 * 4 * 8
