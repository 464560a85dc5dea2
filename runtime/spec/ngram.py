"""n-gram prompt lookup, the proposer that needs no model (vLLM's `ngram`, SGLang's prompt lookup): the drafts
are the tokens that followed the latest earlier occurrence of the sequence's last n tokens, longest n first.

It runs in the scheduler, which holds every request's tokens. A per-request index (last position of every
n-gram seen so far, for each n) grows by the tokens appended since the last call, so a proposal costs
O(new tokens x n range), not a scan of the whole context.

Shared corpus (`NgramCorpus`, as SGLang's n-gram cache and llama.cpp's NgramCache): finished requests' tokens,
one index for every request of a scheduler, bounded by `--speculative-ngram-capacity` tokens (oldest request out
first). A request drafts from it when it matches a longer suffix there than in its own context: answers to
similar prompts repeat each other's phrasing.

Adaptive draft count (`propose_drafts`): how far a match continues depends on how long it is. Measured on the
trained spec pair (gsm8k, greedy, k = 8): after a 1- or 2-token match the target takes a 3rd draft about 1 time
in 10, after a 4-token match (a loop, a copied span) it takes all 8 about 4 times in 10. A window position
costs a fraction of a step, so a short match drafts `SHORT_MATCH_DRAFTS` and a match of `LONG_MATCH` tokens or
more drafts up to k.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

SHORT_MATCH_DRAFTS = {1: 2, 2: 2, 3: 4}  # drafts after a match of n tokens, below LONG_MATCH
LONG_MATCH = 4


class NgramMatch(NamedTuple):
    n: int  # tokens of the matched suffix (0: no match)
    drafts: list[int]


def draft_budget(n: int, k: int, max_n: int = LONG_MATCH) -> int:
    """Drafts worth proposing after a match of n tokens, at most k; a match of max_n (the longest the index
    looks for) counts as long."""
    return k if n >= min(LONG_MATCH, max_n) else min(k, SHORT_MATCH_DRAFTS.get(n, 0))


@dataclass
class NgramIndex:
    """For each n in [min_n, max_n], the latest end position of every n-gram of the tokens indexed so far."""

    min_n: int
    max_n: int
    indexed: int = 0  # tokens [0, indexed) are in `last_end`
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)

    def propose(self, ids: list[int], k: int) -> list[int]:
        """Up to k drafts continuing `ids` (which extends what earlier calls saw), or [] if no n-gram recurs."""
        return self.lookup(ids, k).drafts

    def lookup(self, ids: list[int], k: int) -> NgramMatch:
        """The longest recurring suffix of `ids` and up to k tokens that followed its latest occurrence."""
        if len(ids) < self.indexed:  # the sequence was cut back (cannot happen today): index from scratch
            self.indexed, self.last_end = 0, {}
        n_ids = len(ids)
        # Index the n-grams that end before the last token (the suffix must not match itself); the value is
        # where the tokens following the n-gram start.
        for key, stop in _ngrams(ids, self.min_n, self.max_n, max(self.indexed, 1), n_ids):
            self.last_end[key] = stop
        self.indexed = max(self.indexed, n_ids)
        n, end = _suffix_match(self.last_end, ids, self.min_n, self.max_n)
        return NgramMatch(n, ids[end : end + k] if n else [])


def _ngrams(ids: Sequence[int], lo: int, hi: int, first: int, stop: int) -> Iterator[tuple[tuple[int, ...], int]]:
    """(n-gram, where it ends) for every n-gram of `ids` with n in [lo, hi] ending at first .. stop - 1."""
    for end in range(first, stop):
        for n in range(lo, min(hi, end) + 1):
            yield tuple(ids[end - n : end]), end


def _suffix_match(last_end: dict[tuple[int, ...], int], ids: Sequence[int], lo: int, hi: int) -> tuple[int, int]:
    """(n, end) of the longest suffix of `ids` with n in [lo, hi] that `last_end` holds; (0, -1) if none."""
    for n in range(min(hi, len(ids)), lo - 1, -1):
        end = last_end.get(tuple(ids[len(ids) - n :]))
        if end is not None:
            return n, end
    return 0, -1


SEPARATOR = -1  # ends each request in the corpus: no token id, so drafts stop there and no n-gram spans it


@dataclass
class NgramCorpus:
    """Finished requests' tokens, each followed by SEPARATOR, and for each n in [min_n, max_n] where each n-gram
    in them last ended. Positions are virtual: `tokens[i]` is position `base + i`; evicting the oldest request
    advances `base`."""

    min_n: int
    max_n: int
    capacity: int  # tokens kept (separators not counted), at most
    base: int = 0
    tokens: list[int] = field(default_factory=list)
    docs: deque[int] = field(default_factory=deque)  # entries in `tokens` per request held, oldest first
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"an n-gram corpus holds at least one token, got capacity {self.capacity}")

    def add(self, ids: Sequence[int]) -> None:
        """Index a finished request's tokens (its last `capacity` at most), evicting the oldest to fit."""
        doc = [*ids[-self.capacity :], SEPARATOR]
        start = self.base + len(self.tokens)
        self.tokens += doc
        self.docs.append(len(doc))
        for key, end in _ngrams(doc, self.min_n, self.max_n, 1, len(doc) - 1):  # each with a token after it
            self.last_end[key] = start + end
        while len(self.tokens) - len(self.docs) > self.capacity:
            self._evict_oldest()

    def clear(self) -> None:
        self.base, self.tokens, self.docs, self.last_end = 0, [], deque(), {}

    def _evict_oldest(self) -> None:
        size = self.docs.popleft()
        for key, end in _ngrams(self.tokens, self.min_n, self.max_n, 1, size - 1):
            if self.last_end.get(key) == self.base + end:  # drop the entries that still point into it
                del self.last_end[key]
        del self.tokens[:size]
        self.base += size

    def lookup(self, ids: Sequence[int], k: int) -> NgramMatch:
        """The longest suffix of `ids` that occurs in the corpus, and up to k tokens that followed it there
        (never past the end of the request it occurred in)."""
        n, end = _suffix_match(self.last_end, ids, self.min_n, self.max_n)
        if not n:
            return NgramMatch(0, [])
        drafts = self.tokens[end - self.base : end - self.base + k]
        return NgramMatch(n, drafts[: drafts.index(SEPARATOR)] if SEPARATOR in drafts else drafts)

    def check_integrity(self) -> None:
        assert sum(self.docs) == len(self.tokens) <= self.capacity + len(self.docs), "docs and tokens disagree"
        assert self.tokens.count(SEPARATOR) == len(self.docs), "one separator ends each request"
        for key, end in self.last_end.items():
            i = end - self.base
            assert len(key) <= i < len(self.tokens) and self.tokens[i] != SEPARATOR, f"{key} has no token after it"
            assert tuple(self.tokens[i - len(key) : i]) == key, f"{key} is not where the index says"


def propose_drafts(own: NgramIndex, corpus: NgramCorpus | None, ids: list[int], k: int) -> list[int]:
    """A request's drafts: from the longer of its own match and the corpus's (its own on a tie: the nearer
    context), as many as that match length earns (`draft_budget`)."""
    match = own.lookup(ids, k)
    if corpus is not None:
        shared = corpus.lookup(ids, k)
        if shared.n > match.n:
            match = shared
    return match.drafts[: draft_budget(match.n, k, own.max_n)]
