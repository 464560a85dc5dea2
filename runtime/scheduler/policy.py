"""Scheduling policy: the order of the waiting queue, in-batch prefix sharing, and the new-token ratio.

In-batch prefix sharing (SGLang's in-batch prefix caching): requests that share a prefix not yet in the
tree, with each other or with a request being prefilled, would each compute it. Instead the first is
admitted as the leader and asked to checkpoint its state at the end of the shared part; the followers wait
in the queue until that checkpoint is in the tree, then hit it. Nothing is remembered between steps: every
step the waiting requests are matched afresh against the requests that can still produce the checkpoint.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from runtime.scheduler.radix_cache import HybridRadixCache
from runtime.scheduler.request import Req

# A follower waits for a leader only if that saves it at least this many prefill tokens (SGLang: 32).
IN_BATCH_PREFIX_MIN = 32

# Admission reserves pages for `ratio * max_new_tokens` decode tokens (SGLang's new_token_ratio): most
# requests stop early. The ratio decays towards the floor while decoding goes well and jumps back up after
# a retraction.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600


class NewTokenRatio:
    """`conservativeness` scales the ratio and its floor (SGLang's --schedule-conservativeness)."""

    def __init__(self, conservativeness: float = 1.0) -> None:
        self.init = min(1.0, INIT_NEW_TOKEN_RATIO * conservativeness)
        self.floor = min(1.0, MIN_NEW_TOKEN_RATIO * conservativeness)
        self.value = self.init

    def on_decode_step(self) -> None:
        self.value = max(self.floor, self.value - NEW_TOKEN_RATIO_DECAY)

    def on_retract(self) -> None:
        self.value = max(self.value, self.init)


def order_waiting(waiting: deque[Req], cache: HybridRadixCache | None, match_ids: Callable[[Req], list[int]],
                  policy: str, lpm_max_queue: int) -> deque[Req]:
    """Longest prefix match first (requests that share cached prefixes run while those are hot), FCFS
    among equals; plain FCFS without a cache, for the fcfs policy, or when the queue is long."""
    if cache is None or policy == "fcfs" or len(waiting) > lpm_max_queue:
        return waiting
    return deque(sorted(waiting, key=lambda r: (-cache.match_prefix(match_ids(r)).prefix_len, r.arrival)))


def running_prefill_share(budget: int, page_size: int) -> int:
    """The part of a step's prefill budget that the running prefills take first while other requests wait to
    start: half of it (whole pages, at least one). The waiting requests are admitted into the rest, and what
    they leave of it returns to the running prefills: neither side starves the other."""
    return max(page_size, budget // 2 // page_size * page_size)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token lists (binary search over slice compares, in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def shared_prefix_leader(ids: list[int], prefix_len: int, sources: Sequence[Req],
                         page_size: int) -> tuple[Req, int] | None:
    """The request among `sources` (running requests still prefilling) that can checkpoint the longest
    prefix of `ids` beyond the cached `prefix_len`, and that prefix's (page-aligned) length; None if no
    source would save IN_BATCH_PREFIX_MIN tokens. `ids` are the tokens to match (the last one never is)."""
    best: tuple[Req, int] | None = None
    limit = (len(ids) - 1) // page_size * page_size
    for src in sources:
        n = min(common_prefix_len(ids, src.key_ids(0, min(src.known_len, limit))), limit)
        p = n // page_size * page_size
        if p - prefix_len < IN_BATCH_PREFIX_MIN or (best is not None and p <= best[1]):
            continue
        # The source must still compute position p, or have its checkpoint there planned already.
        if p > src.num_computed or p in src.pending_ckpts:
            best = (src, p)
    return best
