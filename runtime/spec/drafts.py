"""What the worker's model proposers share: the packed verify window's layout, and drawing drafts from a
proposal distribution q on the plain sampler's stream."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kernels.sampling import hash_uniform
from kernels.sampling_tensors import SamplingTensors, tempered
from kernels.spec_layout import window_layout as packed_layout
from kernels.spec_sampling import kept


def window_layout(cu_seqlens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per packed token: its sequence and its window position; and the window lengths."""
    lay = packed_layout(cu_seqlens, int(cu_seqlens[-1]))
    return lay.seq, lay.off, lay.lens


def any_sampled(params: SamplingTensors) -> bool:
    """Whether some window position samples (then drafts are drawn and their q handed to the verifier)."""
    return not bool(params.greedy.all())


class DraftWindows(NamedTuple):
    """A verify step's windows as a proposer fills them: window i starts at packed position `starts[i]` and has
    `lens[i]` positions (the last committed token, then `lens[i] - 1` drafts); `probs` [windows, width - 1, vocab]
    receives each draft's q, or is None when every position is greedy (no q is needed)."""

    starts: Tensor
    lens: Tensor
    width: int
    probs: Tensor | None


def draft_windows(cu_seqlens: Tensor, params: SamplingTensors, vocab_size: int) -> DraftWindows:
    _, _, lens = window_layout(cu_seqlens)
    width = int(lens.max())
    probs = None
    if any_sampled(params):
        probs = torch.zeros(lens.numel(), width - 1, vocab_size, device=cu_seqlens.device)
    return DraftWindows(cu_seqlens[:-1], lens, width, probs)


def draw_drafts(logits: Tensor, p: SamplingTensors) -> tuple[Tensor, Tensor]:
    """Drafts [M] and their proposal distributions q [M, V]: greedy rows a point mass at the argmax, sampled
    rows a Gumbel-max draw from the tempered, truncated softmax, on the plain sampler's stream."""
    argmax = logits.argmax(-1)
    q = torch.zeros_like(logits).scatter_(1, argmax[:, None], 1.0)
    z = tempered(logits, p)
    keep = kept(z, p)
    soft = torch.where(keep, z, float("-inf")).softmax(-1)
    gumbel = -torch.log(-torch.log(hash_uniform(p.seed, p.step, logits.shape[-1])))
    drawn = torch.where(keep, z + gumbel, float("-inf")).argmax(-1)
    g = p.greedy[:, None]
    return torch.where(p.greedy, argmax, drawn), torch.where(g, q, soft)


def choose(logits: Tensor, params: SamplingTensors | None) -> tuple[Tensor, Tensor | None]:
    """One draft per row of `logits` [M, V] (fp32): the argmax when `params` is None (every request greedy),
    else `draw_drafts` under row i's sampling parameters, row i of `params`, with q."""
    if params is None:
        return logits.argmax(-1), None
    return draw_drafts(logits, params)
