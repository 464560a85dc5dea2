"""Bidirectional attention over several images packed into one sequence (cu_seqlens), each image attending only
to itself: no per-image loop. On CUDA in half precision, flash attention's varlen kernel; elsewhere SDPA with a
block-diagonal mask (memory grows with the square of the packed length: the CPU path is for tests and small
batches)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class Packing(NamedTuple):
    cu_seqlens: torch.Tensor  # int32 (num_images + 1,): where each image's patches start, then the total
    max_seqlen: int

    @classmethod
    def of(cls, lengths: list[int], device: torch.device) -> Packing:
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
        return cls(cu.to(device), max(lengths))

    def block_mask(self) -> torch.Tensor:
        """(T, T) bool, True where query and key belong to the same image."""
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        image = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
        return image[:, None] == image[None, :]


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing,
                     scale: float) -> torch.Tensor:
    """q, k, v (T, heads, head_dim) -> (T, heads, head_dim)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(q, k, v, packing.cu_seqlens, packing.cu_seqlens, packing.max_seqlen,
                           packing.max_seqlen, scale=scale)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=packing.block_mask(), scale=scale)
    return out.transpose(0, 1)
