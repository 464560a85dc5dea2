"""The DP dispatcher: round robin, shortest queue, and the cache-aware router's approximate trees (matches
equal a brute-force longest common prefix, eviction keeps the cap and drops least recently used leaves) and
its choice (longest match while balanced, smallest tree below the threshold, shortest queue when the loads
diverge)."""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.dp_router import ApproxTree, CacheAwareConfig, DPRouter

seqs = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=12), min_size=0, max_size=25)


def _lcp(a: list[int], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@settings(max_examples=200, deadline=None)
@given(inserted=seqs, queries=seqs)
def test_tree_match_is_longest_common_prefix(inserted: list[list[int]], queries: list[list[int]]) -> None:
    t = ApproxTree()
    for s in inserted:
        t.insert(s)
        t.check_integrity()
    # The tree holds exactly the inserted sequences' distinct prefixes (no token twice).
    prefixes = {tuple(s[:i]) for s in inserted for i in range(1, len(s) + 1)}
    assert t.size == len(prefixes)
    for q in queries + inserted:
        assert t.match(q) == max((_lcp(q, tuple(s)) for s in inserted), default=0)


@settings(max_examples=200, deadline=None)
@given(inserted=seqs, cap=st.integers(0, 30))
def test_tree_eviction_caps_and_keeps_prefixes(inserted: list[list[int]], cap: int) -> None:
    t = ApproxTree()
    for s in inserted:
        t.insert(s)
    held = set(t.sequences())
    dropped = t.evict(cap)
    t.check_integrity()
    assert t.size <= cap
    assert dropped >= 0
    # What remains is a prefix of what was held (leaves go whole, inner nodes only once they are leaves).
    for s in t.sequences():
        assert any(h[: len(s)] == s for h in held)
    if cap >= sum(1 for _ in {tuple(x[:i]) for x in inserted for i in range(1, len(x) + 1)}):
        assert dropped == 0


def test_tree_evicts_least_recently_used_first() -> None:
    t = ApproxTree()
    t.insert([1, 2, 3, 4])
    t.insert([5, 6, 7, 8])
    t.insert([9, 9, 9, 9])
    t.match([1, 2, 3, 4])  # the oldest insert is now the most recently used
    t.evict(8)
    assert sorted(t.sequences()) == [(1, 2, 3, 4), (9, 9, 9, 9)]
    t.evict(4)
    assert t.sequences() == [(1, 2, 3, 4)]


def test_round_robin_cycles() -> None:
    r = DPRouter(3, "round_robin")
    assert [r.route(f"r{i}", [i]) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    r.check_integrity()


def test_shortest_queue_ties_to_lowest_index() -> None:
    r = DPRouter(3, "shortest_queue")
    assert [r.route(f"r{i}", [1]) for i in range(3)] == [0, 1, 2]
    r.finished("r1")
    assert r.route("a", [1]) == 1
    assert r.route("b", [1]) == 0
    r.finished("r2")
    r.finished("r2")  # twice: ignored
    r.finished("never-routed")
    assert r.loads == [2, 1, 0]
    assert r.route("c", [1]) == 2
    r.check_integrity()


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 20), st.lists(st.integers(0, 5), max_size=8)),
                    max_size=80),
       method=st.sampled_from(["round_robin", "shortest_queue", "cache_aware"]), n=st.integers(1, 4))
def test_loads_track_outstanding_requests(ops: list[tuple[bool, int, list[int]]], method: str, n: int) -> None:
    r = DPRouter(n, method, CacheAwareConfig(balance_abs_threshold=2, max_tree_size=20))
    for add, k, toks in ops:
        rid = f"r{k}"
        if add and r.replica_of(rid) is None:
            before = list(r.loads)
            i = r.route(rid, toks)
            assert 0 <= i < n and r.replica_of(rid) == i
            if method == "shortest_queue":
                assert before[i] == min(before) and i == before.index(min(before))
        else:
            r.finished(rid)
        r.check_integrity()


def test_route_refuses_a_routed_id_and_bad_config() -> None:
    r = DPRouter(2, "round_robin")
    r.route("x", [1])
    with pytest.raises(ValueError, match="already routed"):
        r.route("x", [1])
    with pytest.raises(ValueError, match="load balance method"):
        DPRouter(2, "random")
    with pytest.raises(ValueError, match="num_replicas"):
        DPRouter(0)
    for bad in (dict(cache_threshold=1.5), dict(balance_abs_threshold=-1), dict(balance_rel_threshold=0.5),
                dict(max_tree_size=0)):
        with pytest.raises(ValueError):
            CacheAwareConfig(**bad).check_integrity()
    CacheAwareConfig().check_integrity()


def test_cache_aware_follows_the_prefix_while_balanced() -> None:
    g = random.Random(0)
    shared = [g.randrange(1000) for _ in range(100)]
    other = [g.randrange(1000) + 1000 for _ in range(100)]
    r = DPRouter(2, "cache_aware")
    # Both trees empty: no match, the smallest tree (tie: lower queue, lower index).
    assert r.route("a", shared + [1]) == 0
    # A different prompt: replica 0 matches nothing, replica 1's tree is smaller.
    assert r.route("b", other + [1]) == 1
    # Every request sharing a prefix follows it, regardless of round-robin order.
    for i in range(20):
        assert r.route(f"s{i}", shared + [i, i]) == 0
        assert r.route(f"o{i}", other + [i, i]) == 1
    assert r.stats.by_cache == 40 and r.stats.by_tree_size == 2
    r.check_integrity()


def test_cache_aware_below_threshold_goes_to_the_smallest_tree() -> None:
    r = DPRouter(2, "cache_aware", CacheAwareConfig(cache_threshold=0.5))
    assert r.route("a", list(range(10))) == 0
    # Matches 4 of 10 on replica 0 (<= half): to the smaller tree, replica 1.
    assert r.route("b", [0, 1, 2, 3] + [50] * 6) == 1
    # Matches 6 of 10 on replica 0: replica 0.
    assert r.route("c", [0, 1, 2, 3, 4, 5] + [60] * 4) == 0


def test_cache_aware_balances_when_queues_diverge() -> None:
    cfg = CacheAwareConfig(balance_abs_threshold=4, balance_rel_threshold=1.5)
    r = DPRouter(2, "cache_aware", cfg)
    prompt = list(range(50))
    placed = [r.route(f"p{i}", prompt + [i], 1) for i in range(12)]
    # One new token each: the decode work replica 0 owes stays below the 51-token prompt, so five follow the
    # prefix there; then loads 5-0 exceed both thresholds (abs 4, rel 1.5) and the shortest queue takes the
    # next. Both hold the prefix from then on, and the one owing less work takes each request.
    assert placed == [0] * 5 + [1] * 5 + [0, 1]
    assert max(r.loads) - min(r.loads) <= cfg.balance_abs_threshold + 1
    assert r.stats.by_load > 0
    # Once the loads even out again, the prefix wins again.
    for i in range(12):
        r.finished(f"p{i}")
    assert r.route("q", prompt + [99]) == 0  # both trees match 50 of 51: the first
    assert r.stats.by_cache > 6
    r.check_integrity()


def test_cache_aware_tree_size_is_capped() -> None:
    r = DPRouter(2, "cache_aware", CacheAwareConfig(max_tree_size=64))
    g = random.Random(1)
    for i in range(50):
        r.route(f"r{i}", [g.randrange(10_000) for _ in range(30)])
        r.check_integrity()
    assert all(0 < t.size <= 64 for t in r.trees)


def test_single_replica_is_always_zero() -> None:
    for m in ("round_robin", "shortest_queue", "cache_aware"):
        r = DPRouter(1, m)
        assert {r.route(f"r{i}", [i]) for i in range(5)} == {0}


def _burst(r: DPRouter, prefix: list[int], n: int, max_new: int) -> list[int]:
    placed = []
    for i in range(n):
        placed.append(r.route(f"b{i}", prefix + [5000 + i, i], max_new))
        r.check_integrity()
    return placed


def test_cache_aware_spreads_a_one_prefix_burst_once_its_decode_work_outweighs_the_prefix() -> None:
    # A 102-token prompt (a 100-token prefix), 16 new tokens each: replica 0 takes requests while the decode
    # tokens it owes plus a request's own 2 prompt tokens cost no more than the whole prompt on idle replica 1.
    r = DPRouter(2, "cache_aware")
    placed = _burst(r, list(range(100)), 64, max_new=16)
    assert placed[:7] == [0] * 7  # 6 x 16 + 2 = 98 <= 102
    assert placed[7] == 1  # 7 x 16 + 2 = 114 > 102: the prefix again, on replica 1
    assert r.loads == [32, 32]  # from there both hold the prefix and the one owing less takes the next
    assert r.stats.by_tree_size == 1 and r.stats.by_work == 1 and r.stats.by_load == 0
    r.finished("b0")
    assert r.work_cost(0, 102, 100) == 31 * 16 + 2 and r.work_cost(1, 102, 100) == 32 * 16 + 2
    assert r.route("next", list(range(100)) + [1, 2], 16) == 0


def test_cache_aware_keeps_a_long_prefix_with_short_outputs() -> None:
    # A 2,048-token prefix, 2 new tokens each: 64 requests owe 128 decode tokens, far less than the prefix.
    r = DPRouter(2, "cache_aware")
    assert _burst(r, list(range(2048)), 64, max_new=2) == [0] * 64
    assert r.stats.by_cache == 63 and r.stats.by_work == 0


def test_cache_aware_spreads_the_gsm8k_burst() -> None:
    # The shape of bench/distributed.py's burst: an 800-token few-shot prefix, ~70 own tokens, 32 new: the
    # replica holding the prefix takes 26 (26 x 32 > 800 - 70 of work), then the two even out.
    r = DPRouter(2, "cache_aware")
    prefix = list(range(800))
    placed = [r.route(f"q{i}", prefix + list(range(10_000 + 70 * i, 10_000 + 70 * (i + 1))), 32) for i in range(64)]
    assert placed.index(1) == 26 and r.loads == [32, 32]
    r.check_integrity()


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 30), st.integers(0, 2), st.integers(0, 40)),
                    max_size=120),
       n=st.integers(2, 3))
# Both replicas hold the prefix; the second, owing less, takes the third request (a best match, not the first).
@example(ops=[(True, 2, 0, 13), (True, 0, 0, 0), (True, 1, 0, 0)], n=2)
def test_cache_aware_leaves_the_best_match_only_for_less_work_elsewhere(
        ops: list[tuple[bool, int, int, int]], n: int) -> None:
    prefixes = [[p] * 12 for p in range(3)]
    r = DPRouter(n, "cache_aware")
    held: list[list[tuple[int, ...]]] = [[] for _ in range(n)]  # what each tree holds (no eviction at this size)
    for add, k, p, max_new in ops:
        rid = f"r{k}"
        if not add or r.replica_of(rid) is not None:
            r.finished(rid)
            r.check_integrity()
            continue
        toks = prefixes[p] + [100 + k]
        matched = [max((_lcp(toks, s) for s in seqs), default=0) for seqs in held]
        costs = [r.work_cost(i, len(toks), matched[i]) for i in range(n)]
        best = matched.index(max(matched))
        stats, loads = r.stats, list(r.loads)
        i = r.route(rid, toks, max_new)
        held[i].append(tuple(toks))
        if r.stats.by_work > stats.by_work:  # left the best match: elsewhere costs less work
            assert matched[i] < matched[best] and costs[i] < costs[best] and loads[best] > 0
        elif r.stats.by_cache > stats.by_cache:  # a best match (the first, unless another owes less work)
            assert matched[i] == matched[best] and costs[i] == min(costs)
            assert i == best or costs[i] < costs[best]
        r.check_integrity()
