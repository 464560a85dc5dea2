"""n-gram prompt lookup against a brute-force search."""

from __future__ import annotations

import random

from runtime.ngram import NgramIndex


def brute(ids: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(ids) - 1), lo - 1, -1):
        suffix = ids[len(ids) - n :]
        for start in range(len(ids) - n - 1, -1, -1):  # latest earlier occurrence first
            if ids[start : start + n] == suffix:
                return ids[start + n : start + n + k]
    return []


def test_incremental_index_equals_brute_force() -> None:
    g = random.Random(0)
    for trial in range(30):
        ids = [g.randrange(4) for _ in range(g.randrange(1, 6))]
        index = NgramIndex(1 + trial % 2, 3 + trial % 3)
        for _ in range(40):
            assert index.propose(ids, 3) == brute(ids, 3, index.min_n, index.max_n), ids
            ids += [g.randrange(4) for _ in range(g.randrange(1, 4))]


def test_repetition_is_proposed() -> None:
    ids = [7, 8, 9, 10, 11, 7, 8]
    assert NgramIndex(1, 3).propose(ids, 3) == [9, 10, 11]
    assert NgramIndex(1, 3).propose([1, 2, 3], 3) == []
