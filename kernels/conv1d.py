"""Depthwise causal conv1d (the KDA short conv) with per-sequence conv state, plain torch.

As PyTorch's conv1d (cross-correlation) with W-1 zeros of left padding: y_t[c] = sum_j w[c, j] x_{t-W+1+j}[c],
so w[c, W-1] multiplies the current token; no bias. The conv state of a sequence is its last W-1 *pre-conv*
inputs [C, W-1] (oldest first), with the initial state (or zeros) filling in on the left of short sequences.
Math in fp32, outputs in x's dtype; states hold inputs, so they are exact copies in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def apply_activation(y: Tensor, activation: str | None) -> Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported activation {activation!r}")


def conv_history(
    x: Tensor, cu_seqlens: Tensor | None, initial_state: Tensor | None, width: int
) -> tuple[Tensor, Tensor, list[int]]:
    """Each sequence's inputs with its W-1 state rows in front, packed: ([T + N(W-1), C], the row in that
    buffer of each token [T], the bounds of x's sequences)."""
    t, c = x.shape
    bounds = [0, t] if cu_seqlens is None else [int(b) for b in cu_seqlens.tolist()]
    n = len(bounds) - 1
    if initial_state is None:
        initial_state = x.new_zeros(n, c, width - 1)
    if tuple(initial_state.shape) != (n, c, width - 1):
        raise ValueError(f"initial_state shape {tuple(initial_state.shape)} != {(n, c, width - 1)}")
    lens = torch.tensor([bounds[i + 1] - bounds[i] for i in range(n)], dtype=torch.int64, device=x.device)
    seq_of_token = torch.repeat_interleave(torch.arange(n, device=x.device), lens)
    row = torch.arange(t, device=x.device) + (seq_of_token + 1) * (width - 1)
    hist = x.new_empty(t + n * (width - 1), c)
    hist[row] = x
    state_rows = (torch.arange(n, device=x.device) * (width - 1) + torch.cumsum(lens, 0) - lens)[:, None]
    state_rows = state_rows + torch.arange(width - 1, device=x.device)  # [N, W-1]
    hist[state_rows.reshape(-1)] = initial_state.transpose(1, 2).reshape(-1, c).to(x.dtype)
    return hist, row, bounds


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    *,
    cu_seqlens: Tensor | None = None,
    initial_state: Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[Tensor, Tensor]:
    """x [T, C], weight [C, W], initial_state [N, C, W-1] or None (zeros) -> (y [T, C], final_state [N, C, W-1])."""
    width = weight.shape[-1]
    hist, row, bounds = conv_history(x, cu_seqlens, initial_state, width)
    wf = weight.float()
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(width):
        y += wf[:, j] * hist[row - (width - 1) + j].float()
    n = len(bounds) - 1
    ends = torch.tensor(bounds[1:], dtype=torch.int64, device=x.device) + torch.arange(1, n + 1, device=x.device) * (
        width - 1
    )
    final = hist[(ends[:, None] - (width - 1) + torch.arange(width - 1, device=x.device)).reshape(-1)]
    return apply_activation(y, activation).to(x.dtype), final.view(n, width - 1, -1).transpose(1, 2).contiguous()


def causal_conv1d_update(x: Tensor, weight: Tensor, state: Tensor, *, activation: str | None = "silu") -> Tensor:
    """One token per sequence: x [N, C], weight [C, W]; `state` [N, C, W-1] is updated in place."""
    window = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [N, C, W]
    wf = weight.float()
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(weight.shape[-1]):
        y += wf[:, j] * window[..., j].float()  # the same sum order as the prefill
    state.copy_(window[..., 1:])
    return apply_activation(y, activation).to(x.dtype)
