"""n-gram prompt lookup against a brute-force search."""

from __future__ import annotations

import random

from runtime.spec.ngram import NgramIndex


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
    from runtime.spec.ngram import LONG_MATCH, SHORT_MATCH_DRAFTS, draft_budget, propose_drafts

    loop = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    ids = loop * 3 + loop[:LONG_MATCH]  # a long match: the loop continues for up to k tokens
    assert NgramIndex(1, 4).lookup(ids, 8).n == LONG_MATCH
    assert propose_drafts(NgramIndex(1, 4), None, ids, 8) == (loop[LONG_MATCH:] + loop)[:8]
    short = [1, 2, 3, 4, 9, 9, 9, 9, 1]  # only the last token recurs
    assert NgramIndex(1, 4).lookup(short, 8) == (1, short[1:9])
    assert propose_drafts(NgramIndex(1, 4), None, short, 8) == short[1 : 1 + SHORT_MATCH_DRAFTS[1]]
    assert propose_drafts(NgramIndex(1, 4), None, [1, 2, 3], 8) == []
    assert draft_budget(1, 1) == 1 and draft_budget(3, 2) == 2  # never more than k
    assert draft_budget(2, 8, max_n=2) == 8  # the longest match the index looks for counts as long


def brute_corpus(docs: list[list[int]], ids: list[int], k: int, lo: int, hi: int) -> tuple[int, list[int]]:
    """The longest suffix of ids (n in [lo, hi]) found inside one doc with a token after it; its latest
    occurrence (later docs first), and up to k tokens after it within that doc."""
    for n in range(min(hi, len(ids)), lo - 1, -1):
        suffix = ids[len(ids) - n :]
        for doc in reversed(docs):
            for start in range(len(doc) - n - 1, -1, -1):
                if doc[start : start + n] == suffix:
                    return n, doc[start + n : start + n + k]
    return 0, []


def test_corpus_equals_brute_force_with_eviction() -> None:
    from runtime.spec.ngram import NgramCorpus

    g = random.Random(1)
    for trial in range(20):
        lo, hi, cap = 1 + trial % 2, 2 + trial % 3, 10 + 7 * (trial % 4)
        corpus = NgramCorpus(lo, hi, cap)
        kept: list[list[int]] = []
        for _ in range(12):
            doc = [g.randrange(5) for _ in range(g.randrange(1, 15))]
            corpus.add(doc)
            kept.append(doc[-cap:])
            while sum(map(len, kept)) > cap:  # oldest requests out first
                kept.pop(0)
            corpus.check_integrity()
            assert corpus.held() == kept
            for _ in range(5):
                ids = [g.randrange(5) for _ in range(g.randrange(1, 6))]
                assert tuple(corpus.lookup(ids, 4)) == brute_corpus(kept, ids, 4, lo, hi), (kept, ids)


def test_a_request_drafts_from_an_earlier_one_where_its_own_context_matches_less() -> None:
    from runtime.spec.ngram import NgramCorpus, draft_budget, propose_drafts

    answer = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    corpus = NgramCorpus(1, 4, 1000)
    corpus.add([1, 2, 3] + answer)
    ids = [9, 8, 7] + answer[:4]  # the new request starts the same answer: a 4-token match in the corpus
    assert propose_drafts(NgramIndex(1, 4), corpus, ids, 8) == answer[4:]  # only to the earlier request's end
    assert propose_drafts(NgramIndex(1, 4), None, ids, 8) == []  # its own context has no match
    own = [42, 50, 51, 52, 53] + [40, 41, 42]  # its own 1-token match (42) loses to the corpus's 3 tokens
    assert propose_drafts(NgramIndex(1, 4), corpus, own, 8) == answer[3:3 + draft_budget(3, 8)]
    tie = [41, 60, 61, 62, 63, 41]  # equal (1-token) matches: its own context wins
    assert propose_drafts(NgramIndex(1, 4), corpus, tie, 8) == [60, 61][: draft_budget(1, 8)]
    corpus.clear()
    corpus.check_integrity()
    assert corpus.lookup(ids, 8) == (0, [])


def test_corpus_with_running_requests_equals_brute_force() -> None:
    """Requests commit tokens in turns (a prompt, then runs of outputs) while others run and end; the corpus
    holds each one's tokens as a document in the order they began, the oldest out first (a request evicted while
    it runs starts a new document with its next tokens), and a lookup equals the brute-force search."""
    from runtime.spec.ngram import CorpusDoc, NgramCorpus

    g = random.Random(2)
    for trial in range(40):
        lo, hi, cap = 1 + trial % 2, 2 + trial % 3, 8 + 9 * (trial % 5)
        corpus = NgramCorpus(lo, hi, cap)
        kept: list[list[int]] = []  # the documents held, oldest first (the brute-force model)
        # running request -> its corpus document, its document in `kept`, all its tokens
        running: dict[int, tuple[CorpusDoc, list[int], list[int]]] = {}
        for step in range(60):
            if running and g.random() < 0.15:  # a request ends: its document stays
                del running[g.choice(list(running))]
                continue
            if not running or g.random() < 0.25:  # a request is admitted: its prompt
                r, doc, doc_ids, ids = step, None, None, []
                new = [g.randrange(5) for _ in range(g.randrange(1, 12))]
            else:  # a running request's accepted outputs
                r = g.choice(list(running))
                doc, doc_ids, ids = running[r]
                new = [g.randrange(5) for _ in range(g.randrange(1, 4))]
            doc = corpus.extend(doc, new)
            if doc_ids is None or all(d is not doc_ids for d in kept):  # a new document, or the old one evicted
                doc_ids = []
                kept.append(doc_ids)
            doc_ids += new
            del doc_ids[: max(0, len(doc_ids) - cap)]  # alone past the capacity: its latest tokens
            while sum(map(len, kept)) > cap:
                kept.pop(0)
            ids = ids + new
            running[r] = (doc, doc_ids, ids)
            corpus.check_integrity()
            assert corpus.held() == kept
            assert doc.seen == len(ids) and (doc.evicted or doc.tokens == ids[doc.base :])
            for _ in range(4):
                q = [g.randrange(5) for _ in range(g.randrange(1, 6))]
                assert tuple(corpus.lookup(q, 4)) == brute_corpus(kept, q, 4, lo, hi), (kept, q)


def test_running_requests_draft_from_each_other() -> None:
    """Two requests running at once: each drafts from what the other committed so far, up to its last token."""
    from runtime.spec.ngram import NgramCorpus, propose_drafts

    corpus = NgramCorpus(1, 4, 1000)
    a = corpus.extend(None, [1, 2, 3, 40, 41, 42, 43])  # admitted: its prompt
    b = corpus.extend(None, [9, 8, 7])
    b = corpus.extend(b, [40, 41])  # b's first outputs continue a's prompt
    assert propose_drafts(NgramIndex(1, 4), corpus, [9, 8, 7, 40, 41], 8) == [42, 43]
    a = corpus.extend(a, [44, 45, 46])  # a's outputs, as they are accepted
    assert propose_drafts(NgramIndex(1, 4), corpus, [9, 8, 7, 40, 41, 42, 43], 8) == [44, 45, 46]
    assert corpus.extend(a, []) is a and corpus.extend(b, []) is b and len(corpus.docs) == 2
    corpus.check_integrity()
