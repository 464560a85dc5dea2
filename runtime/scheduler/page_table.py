"""The scheduler's side of the worker's page table: which row each running request owns, and which of the
row's entries the worker still lacks.

The worker holds `table[row, col]` = physical KV page of the request's column `col` (its tokens
[col*page_size, (col+1)*page_size)). A plan carries only what changed: the columns of newly allocated
pages, the columns whose page a checkpoint insert swapped for the tree's copy, and every column of a row
just (re)assigned. Compaction moves are not entries: the worker renames moved pages itself (`page_moves`),
so entries are resolved to physical ids only when the plan is built, after the step's allocations.
A row is given back only when its request is in no step in flight (the scheduler releases requests then),
so a plan never renames or overwrites the row of a step the worker has not run yet.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import numpy as np

from runtime.scheduler.pool import UnifiedPool
from runtime.scheduler.request import Req


class PageTables:
    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free = list(range(num_rows))  # a heap: the lowest free row first keeps the table dense
        self._writes: list[tuple[int, int, int]] = []  # (row, col, virtual page)
        self._resets: list[tuple[int, list[int]]] = []

    def assign(self, req: Req) -> None:
        """Give `req` a row; the worker resets it (penalty history = the outputs so far) and every column
        is written with the request's next plan."""
        if req.row is not None:
            raise ValueError(f"request {req.rid} already owns row {req.row}")
        if not self._free:
            raise RuntimeError("no free page-table row: more running requests than max_running_requests")
        req.row = heapq.heappop(self._free)
        req.table_cols = 0
        req.dirty_cols.clear()
        self._resets.append((req.row, list(req.output_ids)))

    def release(self, req: Req) -> None:
        if req.row is None:
            return
        heapq.heappush(self._free, req.row)
        req.row, req.table_cols = None, 0
        req.dirty_cols.clear()

    def mark_changed(self, req: Req, cols: Iterable[int]) -> None:
        """Columns whose page changed after the worker got them (a checkpoint swapped duplicates)."""
        req.dirty_cols.update(c for c in cols if c < req.table_cols)

    def truncate(self, req: Req) -> None:
        """`req` gave back its last pages: the worker's entries past them are stale, rewritten when it grows."""
        req.table_cols = min(req.table_cols, len(req.pages))
        req.dirty_cols = {c for c in req.dirty_cols if c < req.table_cols}

    def sync(self, req: Req) -> None:
        """Queue the entries of `req`'s row that the worker lacks: it is in the plan being built."""
        assert req.row is not None, f"request {req.rid} has no row"
        for col in sorted(req.dirty_cols):
            self._writes.append((req.row, col, req.pages[col]))
        req.dirty_cols.clear()
        for col in range(req.table_cols, len(req.pages)):
            self._writes.append((req.row, col, req.pages[col]))
        req.table_cols = len(req.pages)

    def drain(self, pool: UnifiedPool) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, list[int]]]]:
        """The queued entries as (rows, cols, physical pages) arrays, and the row resets."""
        w, self._writes = self._writes, []
        resets, self._resets = self._resets, []
        rows = np.fromiter((r for r, _, _ in w), np.int64, len(w))
        cols = np.fromiter((c for _, c, _ in w), np.int64, len(w))
        pages = np.fromiter((pool.page_index(p) for _, _, p in w), np.int64, len(w))
        return rows, cols, pages, resets

    def check_integrity(self, holders: Iterable[Req]) -> None:
        rows = [r.row for r in holders]
        assert None not in rows, "a running request has no page-table row"
        assert len(set(rows)) == len(rows), "two requests own one page-table row"
        assert not set(rows) & set(self._free), "a row is both owned and free"
        assert set(rows) | set(self._free) == set(range(self.num_rows)), "a page-table row leaked"
        for r in holders:
            assert r.table_cols <= len(r.pages), f"request {r.rid}: the worker holds more columns than pages"
