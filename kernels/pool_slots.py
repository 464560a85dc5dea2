"""Whole-slot gathers and scatters on pool tensors (the torch paths of the pool ops).

index_select / index_copy_ move whole rows and are cheaper on CPU than advanced indexing for large slots; both work in
place on the pool buffer's strided per-layer views (a slot stride larger than a slot), and copy exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor


def gather_slots(pool: Tensor, slots: Tensor) -> Tensor:
    """pool[slots] as a new tensor: index_select copies whole slots (faster than advanced indexing on CPU)."""
    return pool.index_select(0, slots.to(device=pool.device, dtype=torch.int64))


def scatter_slots(pool: Tensor, slots: Tensor, values: Tensor) -> None:
    """pool[slots] = values in place (slots distinct); works on the pool buffer's strided per-layer views."""
    pool.index_copy_(0, slots.to(device=pool.device, dtype=torch.int64), values.to(pool.dtype))


def window_positions(cu_seqlens: Tensor, total: int) -> tuple[Tensor, Tensor, int]:
    """Sequence and in-sequence offset of every packed token ([T] int64 each), and the longest sequence."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=cu_seqlens.device), lens, output_size=total)
    off = torch.arange(total, device=cu_seqlens.device) - cu_seqlens[:-1][seq]
    return seq, off, int(lens.max()) if lens.numel() else 0

