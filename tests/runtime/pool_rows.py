"""Where a sequence's tokens lie in the worker's KV views: the rows that the scheduler's pages address."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.paged_kv import paged_slots
from runtime.scheduler.pool import UnifiedPool


def token_rows(pool: UnifiedPool, pages: Sequence[int], start: int, end: int) -> list[int]:
    """Rows of the per-layer KV views holding positions [start, end) of a sequence whose KV lives in `pages`:
    the physical page indices that the page table sends the worker, addressed as the MLA kernels address them."""
    ps = pool.geometry.page_size
    first = start // ps  # pages before it are not read (a caller may pass placeholders there)
    table = torch.tensor([[pool.page_index(p) for p in pages[first:-(-end // ps)]]], dtype=torch.int64)
    pos = torch.arange(start - first * ps, end - first * ps, dtype=torch.int64)
    return paged_slots(table, torch.zeros_like(pos), pos, ps).tolist()
