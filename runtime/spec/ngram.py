"""n-gram prompt lookup, the proposer that needs no model (vLLM's `ngram`, SGLang's prompt lookup): the drafts
are the tokens that followed the latest earlier occurrence of the sequence's last n tokens, longest n first.

It runs in the scheduler, which holds every request's tokens. A per-request index (last position of every
n-gram seen so far, for each n) grows by the tokens appended since the last call, so a proposal costs
O(new tokens x n range), not a scan of the whole context.

Shared corpus (`NgramCorpus`, as SGLang's n-gram cache and llama.cpp's NgramCache): every request's committed
tokens, running ones included (the prompt from admission, outputs as they are accepted), one index for every
request of a scheduler, bounded by `--speculative-ngram-capacity` tokens (oldest request out first). A request
drafts from it when it matches a longer suffix there than in its own context: answers to similar prompts repeat
each other's phrasing, and requests running together draft from each other.

Adaptive draft count (`propose_drafts`): how far a match continues depends on how long it is. Measured on the
trained spec pair (gsm8k, greedy, k = 8): after a 1- or 2-token match the target takes a 3rd draft about 1 time
in 10, after a 4-token match (a loop, a copied span) it takes all 8 about 4 times in 10. A window position
costs a fraction of a step, so a short match drafts `SHORT_MATCH_DRAFTS` and a match of `LONG_MATCH` tokens or
more drafts up to k.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

SHORT_MATCH_DRAFTS = {1: 2, 2: 2, 3: 4}  # drafts after a match of n tokens, below LONG_MATCH
LONG_MATCH = 4
V = TypeVar("V")


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
        return NgramMatch(n, ids[end : end + k] if end is not None else [])


def _ngrams(ids: Sequence[int], lo: int, hi: int, first: int, stop: int) -> Iterator[tuple[tuple[int, ...], int]]:
    """(n-gram, where it ends) for every n-gram of `ids` with n in [lo, hi] ending at first .. stop - 1."""
    for end in range(first, stop):
        for n in range(lo, min(hi, end) + 1):
            yield tuple(ids[end - n : end]), end


def _suffix_match(last_end: Mapping[tuple[int, ...], V], ids: Sequence[int], lo: int, hi: int) -> tuple[int, V | None]:
    """(n, where) of the longest suffix of `ids` with n in [lo, hi] that `last_end` holds; (0, None) if none."""
    for n in range(min(hi, len(ids)), lo - 1, -1):
        where = last_end.get(tuple(ids[len(ids) - n :]))
        if where is not None:
            return n, where
    return 0, None


@dataclass(eq=False)
class CorpusDoc:
    """One request's tokens in the corpus. The request keeps it and extends it as it commits tokens
    (`NgramCorpus.extend`); position p of the request is `tokens[p - base]`."""

    serial: int  # creation order: a newer document's occurrence of an n-gram is preferred
    tokens: list[int] = field(default_factory=list)  # the request's tokens held: [base, seen)
    base: int = 0  # request positions before it were dropped (the request alone outgrew the corpus)
    evicted: bool = False  # out of the corpus: the request's next tokens start a new document

    @property
    def seen(self) -> int:
        """The request's tokens handed to the corpus so far (held, or dropped from the front)."""
        return self.base + len(self.tokens)


@dataclass
class NgramCorpus:
    """Requests' committed tokens, running and finished, one document per request (oldest first), and for
    each n in [min_n, max_n] where each n-gram in them occurs followed by a token: (document, request position of
    that token) of its occurrence in the newest document holding it, the latest there. At most `capacity` tokens
    are held; the oldest documents go first, whole, and a document longer than `capacity` alone keeps its latest
    tokens. (Newest document, not latest commit: an entry pointing into the oldest document then means no other
    holds the n-gram, so eviction forgets nothing still held; a running old request's tokens do not shadow a
    newer request's.)

    Cost: `extend` indexes only the tokens it is given, O(new tokens x (max_n - min_n + 1)); eviction drops each
    token once, at the same cost; `lookup` is at most max_n - min_n + 1 dict probes and a k-token slice. Nothing
    walks the corpus but `check_integrity` and `held` (tests)."""

    min_n: int
    max_n: int
    capacity: int  # tokens held, at most
    size: int = 0  # tokens held
    created: int = 0  # documents made so far (the next one's serial)
    docs: deque[CorpusDoc] = field(default_factory=deque)  # oldest first
    last_end: dict[tuple[int, ...], tuple[CorpusDoc, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"an n-gram corpus holds at least one token, got capacity {self.capacity}")

    def add(self, ids: Sequence[int]) -> CorpusDoc:
        """Index a whole request's tokens as a new document."""
        return self.extend(None, ids)

    def extend(self, doc: CorpusDoc | None, ids: Sequence[int]) -> CorpusDoc:
        """Index `ids`, the tokens a request committed since it last called with `doc` (None: its first call),
        and return its document: `doc`, or a new one if there was none or `doc` was evicted."""
        if doc is None or doc.evicted:
            doc = CorpusDoc(self.created, base=0 if doc is None else doc.seen)
            self.created += 1
            self.docs.append(doc)
        over = len(doc.tokens) + len(ids) - self.capacity
        if over > 0:  # the request alone outgrows the corpus: it keeps its latest tokens
            dropped = min(over, len(doc.tokens))
            self._drop_front(doc, dropped)
            doc.base += over - dropped  # and skips the oldest of `ids` if it held fewer than `over`
            ids = ids[over - dropped :]
        old = len(doc.tokens)
        doc.tokens += ids
        self.size += len(ids)
        for key, end in _ngrams(doc.tokens, self.min_n, self.max_n, max(old, 1), len(doc.tokens)):
            where = self.last_end.get(key)
            if where is None or where[0].serial <= doc.serial:  # the newest document's occurrence wins
                self.last_end[key] = (doc, doc.base + end)
        while self.size > self.capacity:
            self._evict_oldest()
        return doc

    def clear(self) -> None:
        for doc in self.docs:
            doc.evicted = True
        self.size, self.docs, self.last_end = 0, deque(), {}

    def _evict_oldest(self) -> None:
        doc = self.docs.popleft()
        self._drop_front(doc, len(doc.tokens))
        doc.evicted = True

    def _drop_front(self, doc: CorpusDoc, count: int) -> None:
        """Forget `doc`'s first `count` tokens and the index entries of n-grams starting among them. Exact: `doc`
        is the oldest document (nothing older holds what its entries point at), or it outgrew the capacity and
        every older document goes before `extend` returns."""
        for key, end in _ngrams(doc.tokens, self.min_n, self.max_n, 1, min(count + self.max_n, len(doc.tokens))):
            if end - len(key) < count and self.last_end.get(key) == (doc, doc.base + end):
                del self.last_end[key]
        del doc.tokens[:count]
        doc.base += count
        self.size -= count

    def lookup(self, ids: Sequence[int], k: int) -> NgramMatch:
        """The longest suffix of `ids` that occurs in the corpus with a token after it, and up to k tokens that
        follow it in the newest request holding it (as far as that one has committed them)."""
        n, where = _suffix_match(self.last_end, ids, self.min_n, self.max_n)
        if where is None:
            return NgramMatch(0, [])
        doc, end = where
        return NgramMatch(n, doc.tokens[end - doc.base : end - doc.base + k])

    def held(self) -> list[list[int]]:
        """Every document's tokens held, oldest first (tests)."""
        return [list(d.tokens) for d in self.docs]

    def check_integrity(self) -> None:
        assert self.size == sum(len(d.tokens) for d in self.docs) <= self.capacity, "size and documents disagree"
        assert not any(d.evicted for d in self.docs), "an evicted document is still held"
        held = {id(d) for d in self.docs}
        serials = [d.serial for d in self.docs]
        assert serials == sorted(set(serials)) and all(s < self.created for s in serials), "documents out of order"
        for key, (doc, end) in self.last_end.items():
            i = end - doc.base
            assert id(doc) in held, f"{key} points into an evicted document"
            assert len(key) <= i < len(doc.tokens), f"{key} has no token after it"
            assert tuple(doc.tokens[i - len(key) : i]) == key, f"{key} is not where the index says"


def propose_drafts(own: NgramIndex, corpus: NgramCorpus | None, ids: list[int], k: int) -> list[int]:
    """A request's drafts: from the longer of its own match and the corpus's (its own on a tie: the nearer
    context), as many as that match length earns (`draft_budget`)."""
    match = own.lookup(ids, k)
    if corpus is not None:
        shared = corpus.lookup(ids, k)
        if shared.n > match.n:
            match = shared
    return match.drafts[: draft_budget(match.n, k, own.max_n)]
