"""n-gram prompt lookup, the proposer that needs no model (vLLM's `ngram`, SGLang's prompt lookup): the drafts
are the tokens that followed the latest earlier occurrence of the sequence's last n tokens, longest n first.

It runs in the scheduler, which holds every request's tokens. A per-request index (last position of every
n-gram seen so far, for each n) grows by the tokens appended since the last call, so a proposal costs
O(new tokens x n range), not a scan of the whole context.

Adaptive draft count (`propose_adaptive`): how far a match continues depends on how long it is. Measured on the
trained spec pair (gsm8k, greedy, k = 8): after a 1- or 2-token match the target takes a 3rd draft about 1 time
in 10, after a 4-token match (a loop, a copied span) it takes all 8 about 4 times in 10. A window position
costs a fraction of a step, so a short match drafts `SHORT_MATCH_DRAFTS` and a match of `LONG_MATCH` tokens or
more drafts up to k.
"""

from __future__ import annotations

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

    def propose_adaptive(self, ids: list[int], k: int) -> list[int]:
        """As `propose`, with the draft count chosen by the match length (`draft_budget`)."""
        n, drafts = self.lookup(ids, k)
        return drafts[: draft_budget(n, k, self.max_n)]

    def lookup(self, ids: list[int], k: int) -> NgramMatch:
        """The longest recurring suffix of `ids` and up to k tokens that followed its latest occurrence."""
        if len(ids) < self.indexed:  # the sequence was cut back (cannot happen today): index from scratch
            self.indexed, self.last_end = 0, {}
        n_ids = len(ids)
        # Index the n-grams that end before the last token (the suffix must not match itself); the value is
        # where the tokens following the n-gram start.
        for stop in range(max(self.indexed, 1), n_ids):
            for n in range(self.min_n, min(self.max_n, stop) + 1):
                self.last_end[tuple(ids[stop - n : stop])] = stop
        self.indexed = max(self.indexed, n_ids)
        for n in range(min(self.max_n, n_ids - 1), self.min_n - 1, -1):
            end = self.last_end.get(tuple(ids[n_ids - n :]))
            if end is not None:
                return NgramMatch(n, ids[end : end + k])
        return NgramMatch(0, [])
