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
