"""Hybrid radix cache: a radix tree over token runs whose nodes hold MLA KV pages and, optionally, one
KDA state checkpoint (the state after the node's last token).

KV is append-only, so it is shared as in any radix cache. KDA state is overwritten at every token, so a
prefix hit is usable only up to the deepest node on the matched path that holds a state: the request
copies that checkpoint into a fresh live block (copy on hit) and recomputes from there. `match_prefix`
also reports how far KV matched beyond it (the branching point), so that the next prefill can emit a
checkpoint exactly there. Nodes may drop their state and keep their KV (tombstones), but no unlocked leaf
is a tombstone: KV below the last state on a path can never be used, so it goes with it. States and KV have
separate LRU orders.

Ownership: `insert` takes the pages and the state block it is given (duplicates of what the tree already
holds are freed at once, so use the returned pages from then on); the tree frees what it evicts.
Locks protect KV: a locked node and its ancestors are never removed. Their states may still be evicted
(a running request has already copied its checkpoint), which is what lets concurrency be bounded by live
states alone; a locked leaf that lost its state is removed when its last lock goes.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from runtime.scheduler.pool import Kind, PoolExhausted, UnifiedPool


@dataclass(eq=False, slots=True)
class Node:
    key: tuple[int, ...]  # the token run on the edge from the parent
    pages: list[int]  # KV pages of those tokens (len(key) // page_size)
    parent: Node | None = field(repr=False)
    depth: int  # tokens from the root to the end of this node
    uid: int
    children: dict[int | tuple[int, ...], Node] = field(default_factory=dict, repr=False)
    state: int | None = None  # checkpoint after the last token of this node
    lock_ref: int = 0  # locks on this node or below it
    own_locks: int = 0  # locks on this node itself
    kv_time: int = 0
    state_time: int = 0
    alive: bool = True
    pinned: bool = False  # its state is being copied into a live block: not a victim


class MatchResult(NamedTuple):
    pages: list[int]  # KV pages of tokens [0, prefix_len): usable as they are
    node: Node  # deepest node on the matched path holding a state (the root when there is none)
    state: int | None  # that node's checkpoint, to copy into the request's live block
    prefix_len: int  # tokens covered by the checkpoint: recompute from here
    branch_len: int  # tokens matched by KV (>= prefix_len): emit a checkpoint here if larger


class InsertResult(NamedTuple):
    node: Node  # the node ending at the inserted length; it holds a state
    pages: list[int]  # the tree's pages for the inserted tokens: use these from now on
    state_taken: bool  # False: the node already had a state, and the one given was freed
    freed_pages: int  # given pages that duplicated the tree's and were freed


class Reclaimable(NamedTuple):
    """What eviction could free: every state block, and the pages of every unlocked node."""

    pages: int
    states: int


class CacheStats(NamedTuple):
    nodes: int
    cached_pages: int
    cached_states: int
    evicted_pages: int
    evicted_states: int


_HeapEntry = tuple[int, int, Node]


class HybridRadixCache:
    def __init__(self, pool: UnifiedPool) -> None:
        self.pool = pool
        self.page_size = pool.geometry.page_size
        self._uid = 0
        self.root = self._node((), [], None, 0)
        self._clock = 0
        self._state_heap: list[_HeapEntry] = []  # LRU candidates for state eviction
        self._kv_heap: list[_HeapEntry] = []  # LRU candidates for leaf (KV) eviction
        self._nodes = 1
        self._pages = 0
        self._states = 0
        self._free_pages = 0  # pages of unlocked nodes
        self._evicted_pages = 0
        self._evicted_states = 0
        pool.attach_evictor(self)

    # --- lookup ----------------------------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """Longest cached prefix of `tokens` usable with a state; the last token is never matched (its
        logits are needed). Refreshes only the consumed node."""
        toks = tuple(tokens)
        ps = self.page_size
        limit = max(0, (len(toks) - 1) // ps * ps)
        node, pos = self.root, 0
        best, best_pos, best_k = self.root, 0, 0
        chunks: list[list[int]] = []
        while pos < limit:
            child = node.children.get(self._key_at(toks, pos))
            if child is None:
                break
            n = self._common(child.key, toks, pos, limit)
            if n == 0:
                break
            chunks.append(child.pages if n == len(child.key) else child.pages[: n // ps])
            pos += n
            if n < len(child.key):
                break
            node = child
            if node.state is not None:
                best, best_pos, best_k = node, pos, len(chunks)
        if best is not self.root:
            self._touch(best)
        pages = [p for chunk in chunks[:best_k] for p in chunk]
        return MatchResult(pages, best, best.state, best_pos, pos)

    def alloc_live_state(self, match: MatchResult) -> int:
        """A fresh state block for a request, with the matched checkpoint queued to be copied into it
        (zero-initialising it is the prefill's job when `match.state` is None). Lock `match.node` first.
        If making room would need the checkpoint itself, the request takes that block over instead of a
        copy (so admission may count the checkpoint as reclaimable)."""
        node = match.node
        if node.state != match.state or not node.alive:
            raise ValueError("stale match: its node changed since match_prefix")
        if match.state is None:
            return self.pool.alloc_state()
        if node.lock_ref == 0:
            raise ValueError("lock match.node before taking a live state from it")
        node.pinned = True
        try:
            live = self.pool.alloc_state()
        except PoolExhausted:
            live, node.state = match.state, None
            self._states -= 1
            return live
        finally:
            node.pinned = False
        self.pool.copy_state(match.state, live)
        return live

    # --- insertion -------------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[int], state: int) -> InsertResult:
        """Cache `tokens` (page-aligned, from the root) with their KV `pages` and the state after the last
        one. Used after a prefill chunk, at a branching point, every N decode tokens, and at request end
        (where the live block itself is donated)."""
        toks = tuple(tokens)
        ps = self.page_size
        if not toks or len(toks) % ps or len(pages) != len(toks) // ps:
            raise ValueError(f"insert needs page-aligned tokens and one page per {ps} tokens, got "
                             f"{len(toks)} tokens and {len(pages)} pages")
        node, pos = self.root, 0
        canonical: list[int] = []
        freed = 0
        while pos < len(toks):
            child = node.children.get(self._key_at(toks, pos))
            if child is None:
                node = self._node(toks[pos:], list(pages[pos // ps :]), node, node.depth + len(toks) - pos)
                canonical.extend(node.pages)
                break
            n = self._common(child.key, toks, pos, len(toks))
            base = pos // ps
            given, held = list(pages[base : base + n // ps]), child.pages[: n // ps]
            # Usually the same pages (a request's earlier chunks already hold the tree's): compared in C.
            dup = [p for p, q in zip(given, held, strict=True) if p != q] if given != held else []
            if dup:
                self.pool.free_pages(dup)
                freed += len(dup)
            canonical.extend(child.pages[: n // ps])
            if n < len(child.key):
                child = self._split(child, n)
            node, pos = child, pos + n
        taken = node.state is None or node.state == state
        if node.state is None:
            node.state = state
            self._states += 1
        elif not taken:
            self.pool.free_state(state)
        self._touch(node)
        return InsertResult(node, canonical, taken, freed)

    # --- locking ---------------------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        """Keep `node` and its ancestors in the tree (their KV is in use); their states stay evictable."""
        if node is not self.root and (node.state is None or not node.alive):
            raise ValueError("only a live node holding a state (or the root) can be locked")
        node.own_locks += 1
        n: Node | None = node
        while n is not None:
            if n.lock_ref == 0:
                self._free_pages -= len(n.pages)
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: Node) -> None:
        if node.own_locks <= 0:
            raise ValueError("unlock of a node that is not locked")
        node.own_locks -= 1
        n: Node | None = node
        while n is not None:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._free_pages += len(n.pages)
                self._push(n)
            n = n.parent
        if node.lock_ref == 0 and node.state is None and not node.children and node is not self.root:
            self._remove_leaf(node)  # its state was evicted while it was in use

    # --- eviction --------------------------------------------------------------------------------------
    def evict(self, kind: Kind, units: int) -> int:
        """Free at least `units` state blocks (tombstoning internal or locked nodes, removing unlocked
        leaves) or KV pages (removing unlocked leaves), least recently used first; return how many."""
        freed = 0
        if kind is Kind.STATE:
            while freed < units and (node := self._pop(self._state_heap, self._is_state_victim)) is not None:
                if node.children or node.lock_ref:
                    self._drop_state(node)
                    freed += 1
                else:
                    freed += self._remove_leaf(node)[1]
        else:
            while freed < units and (node := self._pop(self._kv_heap, self._is_kv_victim)) is not None:
                freed += self._remove_leaf(node)[0]
        return freed

    def reclaimable(self) -> Reclaimable:
        return Reclaimable(self._free_pages, self._states)

    def stats(self) -> CacheStats:
        return CacheStats(self._nodes, self._pages, self._states, self._evicted_pages, self._evicted_states)

    # --- invariants ------------------------------------------------------------------------------------
    def check_integrity(self, held_pages: Iterable[int] | None = None,
                        held_states: Iterable[int] | None = None) -> None:
        """Tree shape, refcounts, the leaf rule, single ownership and the LRU heaps; with `held_*` (what
        live requests own outside the tree) also that the pool holds exactly the tree plus those."""
        self.pool.check_integrity()
        ps = self.page_size
        root = self.root
        assert root.parent is None and not root.key and not root.pages and root.state is None
        tree_pages: list[int] = []
        tree_states: list[int] = []
        free_pages = nodes = 0
        state_entries = {(t, u) for t, u, _ in self._state_heap}
        kv_entries = {(t, u) for t, u, _ in self._kv_heap}
        stack = [root]
        while stack:
            node = stack.pop()
            nodes += 1
            assert node.alive, "dead node reachable"
            assert node.lock_ref == node.own_locks + sum(c.lock_ref for c in node.children.values()), (
                f"node {node.uid}: lock_ref {node.lock_ref} != own {node.own_locks} + children")
            for k, child in node.children.items():
                assert child.parent is node and self._key_of(child.key) == k, f"node {child.uid}: bad link"
                stack.append(child)
            if node is root:
                continue
            assert node.key and len(node.key) == len(node.pages) * ps, f"node {node.uid}: key/pages mismatch"
            assert node.depth == node.parent.depth + len(node.key), f"node {node.uid}: wrong depth"
            assert node.children or node.state is not None or node.lock_ref, (
                f"node {node.uid}: unlocked leaf without a state (a tombstone leaf)")
            assert not node.pinned, f"node {node.uid}: left pinned"
            tree_pages.extend(node.pages)
            if node.state is not None:
                tree_states.append(node.state)
                assert (node.state_time, node.uid) in state_entries, f"node {node.uid}: not in state LRU"
            if node.lock_ref == 0:
                free_pages += len(node.pages)
                if not node.children:
                    assert (node.kv_time, node.uid) in kv_entries, f"node {node.uid}: not in KV LRU"
        assert len(set(tree_pages)) == len(tree_pages), "a KV page is owned by two nodes"
        assert len(set(tree_states)) == len(tree_states), "a state block is owned by two nodes"
        assert all(map(self.pool.is_page, tree_pages)), "the tree holds a freed KV page"
        assert all(map(self.pool.is_state, tree_states)), "the tree holds a freed state block"
        assert (nodes, len(tree_pages), len(tree_states)) == (self._nodes, self._pages, self._states), (
            "node/page/state counters drifted")
        assert free_pages == self._free_pages, "reclaimable page counter drifted"
        if held_pages is not None:
            held = list(held_pages)
            assert len(set(held)) == len(held), "a request holds a KV page twice"
            assert not set(held) & set(tree_pages), "a KV page is owned by a request and the tree"
            assert set(held) | set(tree_pages) == self.pool.live_pages(), "KV pages leaked or unaccounted"
        if held_states is not None:
            held = list(held_states)
            assert len(set(held)) == len(held), "a request holds a state block twice"
            assert not set(held) & set(tree_states), "a state block is owned by a request and the tree"
            assert set(held) | set(tree_states) == self.pool.live_states(), "state blocks leaked or unaccounted"

    # --- internals -------------------------------------------------------------------------------------
    def _node(self, key: tuple[int, ...], pages: list[int], parent: Node | None, depth: int) -> Node:
        node = Node(key, pages, parent, depth, self._uid)
        self._uid += 1
        if parent is not None:
            parent.children[self._key_of(key)] = node
            self._nodes += 1
            self._pages += len(pages)
            self._free_pages += len(pages)  # a new node is unlocked until its inserter locks it
        return node

    def _key_of(self, key: tuple[int, ...]) -> int | tuple[int, ...]:
        return key[0] if self.page_size == 1 else key[: self.page_size]

    def _key_at(self, toks: tuple[int, ...], pos: int) -> int | tuple[int, ...]:
        return toks[pos] if self.page_size == 1 else toks[pos : pos + self.page_size]

    def _common(self, key: tuple[int, ...], toks: tuple[int, ...], pos: int, limit: int) -> int:
        """Page-aligned length of the common prefix of `key` and toks[pos:limit]."""
        lo, hi = 0, min(len(key), limit - pos)
        if toks[pos : pos + hi] == key[:hi]:
            lo = hi
        while lo < hi:  # binary search over slice compares (in C): never a Python loop over the tokens
            mid = (lo + hi + 1) // 2
            if toks[pos + lo : pos + mid] == key[lo:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo - lo % self.page_size

    def _split(self, child: Node, n: int) -> Node:
        """Cut `child`'s edge after `n` tokens; the new upper node takes the first part, without a state."""
        parent = child.parent
        assert parent is not None
        ps = self.page_size
        upper = Node(child.key[:n], child.pages[: n // ps], parent, parent.depth + n, self._uid)
        self._uid += 1
        self._nodes += 1
        upper.lock_ref, upper.kv_time = child.lock_ref, child.kv_time
        parent.children[self._key_of(upper.key)] = upper
        child.key, child.pages, child.parent = child.key[n:], child.pages[n // ps :], upper
        upper.children[self._key_of(child.key)] = child
        return upper

    def _touch(self, node: Node) -> None:
        self._clock += 1
        node.kv_time = self._clock
        if node.state is not None:
            node.state_time = self._clock
        self._push(node)

    def _push(self, node: Node) -> None:
        """Offer `node` to the LRU heaps it may now belong to; stale entries are skipped when popped."""
        if node is self.root:
            return
        if node.state is not None:
            heapq.heappush(self._state_heap, (node.state_time, node.uid, node))
        if not node.children and node.lock_ref == 0:
            heapq.heappush(self._kv_heap, (node.kv_time, node.uid, node))
        if len(self._state_heap) + len(self._kv_heap) > 4 * self._nodes + 256:
            self._rebuild_heaps()

    def _rebuild_heaps(self) -> None:
        nodes = [n for n in self._walk() if n is not self.root]
        self._state_heap = [(n.state_time, n.uid, n) for n in nodes if n.state is not None]
        self._kv_heap = [(n.kv_time, n.uid, n) for n in nodes if not n.children and n.lock_ref == 0]
        heapq.heapify(self._state_heap)
        heapq.heapify(self._kv_heap)

    def _walk(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    @staticmethod
    def _pop(heap: list[_HeapEntry], valid: Callable[[Node, int], bool]) -> Node | None:
        while heap:
            t, _, node = heapq.heappop(heap)
            if valid(node, t):
                return node
        return None

    @staticmethod
    def _is_state_victim(node: Node, t: int) -> bool:
        return node.alive and node.state is not None and not node.pinned and node.state_time == t

    @staticmethod
    def _is_kv_victim(node: Node, t: int) -> bool:
        return node.alive and not node.children and node.lock_ref == 0 and node.kv_time == t

    def _drop_state(self, node: Node) -> None:
        assert node.state is not None and (node.children or node.lock_ref)
        self.pool.free_state(node.state)
        node.state = None
        self._states -= 1
        self._evicted_states += 1

    def _remove_leaf(self, node: Node) -> tuple[int, int]:
        """Remove an unlocked leaf, then every ancestor left as a stateless leaf; return (pages, states)."""
        pages = states = 0
        while True:
            parent = node.parent
            assert parent is not None and not node.children and node.lock_ref == 0
            del parent.children[self._key_of(node.key)]
            node.alive = False
            self.pool.free_pages(node.pages)
            pages += len(node.pages)
            if node.state is not None:
                self.pool.free_state(node.state)
                states += 1
            self._nodes -= 1
            if parent is self.root or parent.children:
                break
            if parent.state is not None or parent.lock_ref:
                self._push(parent)  # a leaf now: a KV victim once unlocked (a locked tombstone waits)
                break
            node = parent
        self._pages -= pages
        self._free_pages -= pages
        self._states -= states
        self._evicted_pages += pages
        self._evicted_states += states
        return pages, states
