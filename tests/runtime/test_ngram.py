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


def test_adaptive_draft_count_follows_the_match_length() -> None:
    from runtime.ngram import LONG_MATCH, SHORT_MATCH_DRAFTS, draft_budget

    loop = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    ids = loop * 3 + loop[:LONG_MATCH]  # a long match: the loop continues for up to k tokens
    assert NgramIndex(1, 4).lookup(ids, 8).n == LONG_MATCH
    assert NgramIndex(1, 4).propose_adaptive(ids, 8) == (loop[LONG_MATCH:] + loop)[:8]
    short = [1, 2, 3, 4, 9, 9, 9, 9, 1]  # only the last token recurs
    assert NgramIndex(1, 4).lookup(short, 8) == (1, short[1:9])
    assert NgramIndex(1, 4).propose_adaptive(short, 8) == short[1 : 1 + SHORT_MATCH_DRAFTS[1]]
    assert NgramIndex(1, 4).propose_adaptive([1, 2, 3], 8) == []
    assert draft_budget(1, 1) == 1 and draft_budget(3, 2) == 2  # never more than k
    assert draft_budget(2, 8, max_n=2) == 8  # the longest match the index looks for counts as long
