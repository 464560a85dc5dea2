"""The packed <-> padded mapping of a verify step's windows, computed once per step.

A verify batch packs N windows of up to W tokens each ([T] rows). The window kernels and the draft window's
ring work on padded [N, W, ...] tensors, so that a window position t is one slice `[:, t]` for every sequence
(no per-position index tensors). When every window has W tokens (batch 1, or equal drafts) packed and padded
are the same memory: `pad` and `unpad` are views.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class WindowLayout(NamedTuple):
    seq: Tensor  # [T] int64: the window of each packed token
    off: Tensor  # [T] int64: its position in the window
    flat: Tensor  # [T] int64: seq * width + off, its row in the padded [N * W] layout
    lens: Tensor  # [N] int64: tokens per window
    num_seqs: int
    width: int  # the longest window
    full: bool  # every window has `width` tokens: packed is padded

    @property
    def total(self) -> int:
        return int(self.seq.numel())


def window_layout(cu_seqlens: Tensor, total: int) -> WindowLayout:
    """The layout of the windows packed by cu_seqlens [N+1] (T = total tokens)."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    n = int(lens.numel())
    seq = torch.repeat_interleave(torch.arange(n, device=cu_seqlens.device), lens, output_size=total)
    off = torch.arange(total, device=cu_seqlens.device) - cu_seqlens[:-1][seq]
    width = int(lens.max()) if n else 0
    return WindowLayout(seq, off, seq * width + off, lens, n, width, total == n * width)


def pad(x: Tensor, lay: WindowLayout) -> Tensor:
    """Packed [T, ...] -> zero-padded [N, W, ...] (a view when the layout is full)."""
    if lay.full:
        return x.view(lay.num_seqs, lay.width, *x.shape[1:])
    out = x.new_zeros(lay.num_seqs * lay.width, *x.shape[1:])
    out.index_copy_(0, lay.flat, x)
    return out.view(lay.num_seqs, lay.width, *x.shape[1:])


def unpad(x: Tensor, lay: WindowLayout) -> Tensor:
    """Padded [N, W, ...] -> packed [T, ...] (a view when the layout is full)."""
    flat = x.reshape(lay.num_seqs * lay.width, *x.shape[2:])
    return flat if lay.full else flat.index_select(0, lay.flat)
