"""Which engine replica serves a request, with `--dp M` replicas behind one front (`--load-balance-method`).

round_robin     replicas in turn.
shortest_queue  the replica with the fewest outstanding requests (routed, not yet finished); ties to the
                lowest index.
cache_aware     as SGLang's router (sgl-router's cache-aware policy): the front keeps an *approximate* radix
                tree per replica of the token ids it routed there (it never asks the replicas what they
                cache), size-capped and LRU-evicted. While the load is balanced, a request goes to the replica
                whose tree matches the longest prefix of it if the match covers more than `cache_threshold`
                of the prompt, else to the replica with the smallest tree (the most room for a new prefix).
                When the queues diverge (max - min > `balance_abs_threshold` and max > `balance_rel_threshold`
                x min) it goes to the shortest queue instead. Either way its tokens join the chosen tree.

                Unlike sgl-router, a matching replica is left once the work it owes exceeds what computing
                the prefix again elsewhere costs (`work_cost`, in tokens: the decode tokens its outstanding
                requests may still produce, each a row in one of its steps, against the prompt tokens a
                replica does not hold). A burst of requests sharing one prefix thus fills the replica that
                cached it until its queued decode work outweighs one prefill of the prefix, then spreads over
                the idle replicas, which each compute the prefix once; a long prefix with short outputs stays.

The router is pure bookkeeping (no sockets, no clocks): the tokenizer manager calls `route` once per request
and `finished` once when the request ends, however it ends.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from runtime.sampling_params import SamplingParams
from runtime.server_args import LOAD_BALANCE_METHODS

DEFAULT_MAX_NEW_TOKENS = SamplingParams.max_new_tokens  # what a request that does not say gets


@dataclass
class CacheAwareConfig:
    """sgl-router's cache-aware knobs, with its (current) defaults. SGLang evicts from a background thread every
    `eviction_interval_secs`; here the cap is enforced at insert time, so there is no interval."""

    cache_threshold: float = 0.3  # prefix match share above which the best-matching replica is chosen
    balance_abs_threshold: int = 64  # imbalanced only if max - min outstanding exceeds this ...
    balance_rel_threshold: float = 1.5  # ... and max exceeds this times min
    max_tree_size: int = 2**26  # tokens per replica's tree before LRU leaves are evicted

    def check_integrity(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")
        if self.max_tree_size < 1:
            raise ValueError(f"max_tree_size must be >= 1, got {self.max_tree_size}")


class _Node:
    __slots__ = ("key", "children", "parent", "last")

    def __init__(self, key: tuple[int, ...], parent: _Node | None, last: int) -> None:
        self.key = key  # the edge's tokens (empty only at the root)
        self.children: dict[int, _Node] = {}  # by the child's first token
        self.parent = parent
        self.last = last  # logical time of the last match or insert through this node


class ApproxTree:
    """The token ids routed to one replica, as a radix tree; `size` is the tokens it holds."""

    def __init__(self) -> None:
        self._clock = itertools.count(1)  # logical time: LRU order is deterministic
        self.root = _Node((), None, 0)
        self.size = 0

    def match(self, tokens: Sequence[int]) -> int:
        """The length of the longest prefix of `tokens` in the tree; the nodes it passes count as used."""
        now = next(self._clock)
        node, i, n = self.root, 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                break
            child.last = now
            k = _common(child.key, tokens, i)
            i += k
            if k < len(child.key):
                break
            node = child
        return i

    def insert(self, tokens: Sequence[int]) -> None:
        now = next(self._clock)
        node, i, n = self.root, 0, len(tokens)
        node.last = now
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(tuple(tokens[i:]), node, now)
                node.children[tokens[i]] = leaf
                self.size += n - i
                return
            k = _common(child.key, tokens, i)
            if k < len(child.key):  # diverges (or ends) inside the edge: split it
                mid = _Node(child.key[:k], node, now)
                node.children[tokens[i]] = mid
                child.key = child.key[k:]
                child.parent = mid
                mid.children[child.key[0]] = child
                child = mid
            child.last = now
            node, i = child, i + k

    def evict(self, max_size: int) -> int:
        """Drop least recently used leaves until at most `max_size` tokens remain; returns tokens dropped."""
        if self.size <= max_size:
            return 0
        before = self.size
        heap = [(leaf.last, id(leaf), leaf) for leaf in self._leaves()]
        heapq.heapify(heap)
        while self.size > max_size and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self.size -= len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last, id(parent), parent))
        return before - self.size

    def _leaves(self) -> Iterator[_Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                yield node

    def sequences(self) -> list[tuple[int, ...]]:
        """Every root-to-leaf token sequence (tests)."""
        out: list[tuple[int, ...]] = []
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self.root, ())]
        while stack:
            node, path = stack.pop()
            path = path + node.key
            if not node.children and node is not self.root:
                out.append(path)
            stack.extend((c, path) for c in node.children.values())
        return out

    def check_integrity(self) -> None:
        total = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            total += len(node.key)
            for first, child in node.children.items():
                assert child.key and child.key[0] == first, "a child is keyed by its first token"
                assert child.parent is node, "a child's parent link points at its parent"
                stack.append(child)
        assert total == self.size, f"size {self.size} != tokens held {total}"


def _common(key: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    """How many leading tokens of `key` equal `tokens[start:]`."""
    m = min(len(key), len(tokens) - start)
    if tuple(tokens[start:start + m]) == key[:m]:
        return m
    k = 0
    while key[k] == tokens[start + k]:
        k += 1
    return k


class RouteStats(NamedTuple):
    by_cache: int  # cache_aware: sent to the longest match (above the threshold, load balanced)
    by_tree_size: int  # cache_aware: match too short, sent to the smallest tree
    by_load: int  # cache_aware while imbalanced, or shortest_queue / round_robin
    by_work: int  # cache_aware: the longest match owed more work than the prefix costs elsewhere (`work_cost`)


@dataclass
class DPRouter:
    num_replicas: int
    method: str = "cache_aware"
    config: CacheAwareConfig = field(default_factory=CacheAwareConfig)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"load balance method must be one of {', '.join(LOAD_BALANCE_METHODS)}, "
                             f"got {self.method!r}")
        self.config.check_integrity()
        self.loads = [0] * self.num_replicas  # outstanding requests per replica
        self.decode_tokens = [0] * self.num_replicas  # their max_new_tokens, summed
        self.trees = [ApproxTree() for _ in range(self.num_replicas)] if self.method == "cache_aware" else []
        self._where: dict[str, tuple[int, int]] = {}  # outstanding request -> its replica, its max_new_tokens
        self._next = 0  # round robin
        self._stats = [0, 0, 0, 0]

    @property
    def stats(self) -> RouteStats:
        return RouteStats(*self._stats)

    def replica_of(self, rid: str) -> int | None:
        """The replica an outstanding request was routed to; None once it finished (or if never routed)."""
        where = self._where.get(rid)
        return None if where is None else where[0]

    def route(self, rid: str, token_ids: Sequence[int], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> int:
        """Choose the replica for a new request and count it outstanding there until `finished(rid)`."""
        if rid in self._where:
            raise ValueError(f"request {rid!r} is already routed")
        if self.num_replicas == 1:
            r = 0
        elif self.method == "round_robin":
            r, self._next = self._next, (self._next + 1) % self.num_replicas
            self._stats[2] += 1
        elif self.method == "shortest_queue":
            r = self._shortest()
            self._stats[2] += 1
        else:
            r = self._cache_aware(token_ids)
        self._where[rid] = (r, max_new_tokens)
        self.loads[r] += 1
        self.decode_tokens[r] += max_new_tokens
        return r

    def finished(self, rid: str) -> None:
        """The request ended (finished, failed or aborted); unknown or already finished ids are ignored."""
        where = self._where.pop(rid, None)
        if where is not None:
            r, max_new = where
            self.loads[r] -= 1
            self.decode_tokens[r] -= max_new

    def work_cost(self, replica: int, prompt_tokens: int, matched: int) -> int:
        """What a new request adds to, and waits behind, on `replica`, which holds `matched` of its
        `prompt_tokens`, in tokens: the decode tokens the replica's outstanding requests may still produce (their
        max_new_tokens, an upper bound) and the prompt tokens it must prefill. A decode token counts as a
        prefill token: each is a row of some step."""
        return self.decode_tokens[replica] + prompt_tokens - matched

    def _shortest(self) -> int:
        return min(range(self.num_replicas), key=self.loads.__getitem__)  # min keeps the first: lowest index

    def _imbalanced(self) -> bool:
        lo, hi = min(self.loads), max(self.loads)
        c = self.config
        return hi - lo > c.balance_abs_threshold and hi > c.balance_rel_threshold * lo

    def _cache_aware(self, tokens: Sequence[int]) -> int:
        if self._imbalanced():
            r = self._shortest()
            self._stats[2] += 1
        else:
            matched = [t.match(tokens) for t in self.trees]
            best = max(range(self.num_replicas), key=matched.__getitem__)  # the first of the longest
            if tokens and matched[best] / len(tokens) > self.config.cache_threshold:
                # The least work; ties to the best match, then the shorter queue, then the lower index.
                cost = [self.work_cost(i, len(tokens), matched[i]) for i in range(self.num_replicas)]
                r = min(range(self.num_replicas), key=lambda i: (cost[i], i != best, self.loads[i], i))
                self._stats[0 if matched[r] == matched[best] else 3] += 1
            else:  # ties: the shorter queue, then the lower index
                r = min(range(self.num_replicas), key=lambda i: (self.trees[i].size, self.loads[i]))
                self._stats[1] += 1
        tree = self.trees[r]
        tree.insert(tokens)
        tree.evict(self.config.max_tree_size)
        return r

    def check_integrity(self) -> None:
        counts, decode = [0] * self.num_replicas, [0] * self.num_replicas
        for r, max_new in self._where.values():
            counts[r] += 1
            decode[r] += max_new
        assert counts == self.loads, f"loads {self.loads} != outstanding requests per replica {counts}"
        assert decode == self.decode_tokens, f"decode tokens {self.decode_tokens} != outstanding sums {decode}"
        for t in self.trees:
            t.check_integrity()
            assert t.size <= self.config.max_tree_size
