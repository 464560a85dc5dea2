"""The worker's page table (SGLang's `req_to_token`, one entry per page): row r holds the physical KV pages of the
request the scheduler gave row r, so a plan carries only what changed (new pages, moved pages, new rows).

Beside it, per row: the token last sampled (the overlap scheduler plans a decode before it knows that token and
sends -1 for it). The rows' generated tokens, which the penalties count, are the sampler's
(`runtime.worker.sampler`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch


class WorkerPageTable:
    def __init__(self, device: torch.device | str, rows: int = 64, width: int = 64) -> None:
        self.table = torch.zeros(rows, width, dtype=torch.int64, device=device)
        self.last_token = torch.zeros(rows, dtype=torch.int64, device=device)

    @property
    def device(self) -> torch.device:
        return self.table.device

    def _fit(self, rows: int, width: int) -> None:
        """Grow (by doubling) to hold `rows` rows of `width` pages; entries keep their place."""
        r, w = self.table.shape
        if rows <= r and width <= w:
            return
        nr, nw = max(r, 1), max(w, 1)
        while nr < rows:
            nr *= 2
        while nw < width:
            nw *= 2
        table = self.table.new_zeros(nr, nw)
        table[:r, :w] = self.table
        last = self.last_token.new_zeros(nr)
        last[:r] = self.last_token
        self.table, self.last_token = table, last

    def move_pages(self, moves: Iterable[tuple[int, int]]) -> None:
        """Compaction moved physical page src to dst (dst was free): rename src to dst, move after move.
        Entries that no live row uses may hold anything; renaming them too is harmless."""
        for src, dst in moves:
            self.table.masked_fill_(self.table == src, dst)

    def write(self, rows: np.ndarray, cols: np.ndarray, pages: np.ndarray) -> None:
        """table[rows[i], cols[i]] = pages[i]."""
        if len(rows) == 0:
            return
        self._fit(int(rows.max()) + 1, int(cols.max()) + 1)
        r, c, p = (torch.from_numpy(np.array(a, dtype=np.int64)).to(self.device) for a in (rows, cols, pages))
        self.table[r, c] = p

    def block_table(self, rows: np.ndarray, num_pages: int) -> torch.Tensor:
        """The first `num_pages` pages of each row in `rows` (host ints: sizing reads no device tensor)."""
        self._fit(int(rows.max()) + 1 if len(rows) else 0, num_pages)
        return self.table[torch.from_numpy(np.array(rows, dtype=np.int64)).to(self.device), :num_pages]

    def host_block_table(self, rows: np.ndarray, num_pages: int) -> np.ndarray:
        """`block_table` as a new host array, for a table in host memory (CPU)."""
        self._fit(int(rows.max()) + 1 if len(rows) else 0, num_pages)
        return self.table.numpy()[rows, :num_pages]

    def set_last(self, rows: list[int], tokens: torch.Tensor) -> None:
        """The tokens just sampled for `rows`: the next -1 input of each row."""
        if not rows:
            return
        self.last_token[torch.tensor(rows, device=self.device)] = tokens

    def check_integrity(self) -> None:
        assert self.table.shape[0] == self.last_token.shape[0], "rows of the table and of last_token differ"
        assert bool((self.table >= 0).all()), "negative page id in the table"
