"""A paged latent KV's addressing: a page table maps sequence positions to rows (slots) of the buffer,
slot(i, p) = block_table[i, p // page_size] * page_size + p % page_size (page_size 1: one slot per token).
Shared by the paged MLA ops (`mla_paged`) and their Triton kernel (`mla_triton`)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class PagedKV(NamedTuple):
    block_table: Tensor  # [N, max_pages] int64 page ids
    kv_lens: Tensor  # [N] int64 cached tokens per sequence, this step's included
    page_size: int


def paged_slots(block_table: Tensor, seq: Tensor, pos: Tensor, page_size: int) -> Tensor:
    """KV slot of each (sequence, position) pair, [M] int64."""
    return block_table[seq, pos // page_size] * page_size + pos % page_size


def sequence_slots(kv: PagedKV) -> Tensor:
    """The slots of every cached token, sequence after sequence: [sum(kv_lens)] int64."""
    lens = kv.kv_lens.to(torch.int64)
    seq = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(int(lens.sum()), device=lens.device) - starts[seq]
    return paged_slots(kv.block_table, seq, pos, kv.page_size)
