"""n-gram prompt lookup, the proposer that needs no model (vLLM's `ngram`, SGLang's prompt lookup): the drafts
are the tokens that followed the latest earlier occurrence of the sequence's last n tokens, longest n first.

It runs in the scheduler, which holds every request's tokens. A per-request index (last position of every
n-gram seen so far, for each n) grows by the tokens appended since the last call, so a proposal costs
O(new tokens x n range), not a scan of the whole context.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NgramIndex:
    """For each n in [min_n, max_n], the latest end position of every n-gram of the tokens indexed so far."""

    min_n: int
    max_n: int
    indexed: int = 0  # tokens [0, indexed) are in `last_end`
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)

    def propose(self, ids: list[int], k: int) -> list[int]:
        """Up to k drafts continuing `ids` (which extends what earlier calls saw), or [] if no n-gram recurs."""
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
                return ids[end : end + k]
        return []
