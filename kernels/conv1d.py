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


def history_states(hist: Tensor, first_rows: Tensor, width: int) -> Tensor:
    """The conv states [M, C, W-1] held in rows first_rows[m] .. first_rows[m] + W-2 of a `conv_history` buffer."""
    rows = first_rows[:, None] + torch.arange(width - 1, device=hist.device)
    return hist[rows.reshape(-1)].view(len(first_rows), width - 1, -1).transpose(1, 2)


def conv_from_history(hist: Tensor, row: Tensor, weight: Tensor, activation: str | None) -> Tensor:
    """y [T, C] fp32 (activated) of the tokens at `row` of a `conv_history` buffer: w[:, 0] x_{t-W+1} first."""
    width = weight.shape[-1]
    wf = weight.float()
    histf = hist.float()  # once, not per tap: the same fp32 values
    y = torch.zeros(len(row), hist.shape[1], dtype=torch.float32, device=hist.device)
    for j in range(width):
        y += wf[:, j] * histf.index_select(0, row - (width - 1) + j)
    return apply_activation(y, activation)


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
    y = conv_from_history(hist, row, weight, activation)
    n = len(bounds) - 1
    # sequence i's rows start at bounds[i] + i*(W-1); its final state is the last W-1 of them
    last = torch.tensor(bounds[1:], dtype=torch.int64, device=x.device) + torch.arange(n, device=x.device) * (width - 1)
    return y.to(x.dtype), history_states(hist, last, width).contiguous()


def conv_window(window: Tensor, weight: Tensor, activation: str | None) -> Tensor:
    """y [N, C] fp32 (activated) of one token per sequence from its window [N, C, W] of inputs, oldest first."""
    wf = weight.float()
    winf = window.float()  # once, not per tap: the same fp32 values
    y = torch.zeros(window.shape[:-1], dtype=torch.float32, device=window.device)
    for j in range(weight.shape[-1]):
        y += wf[:, j] * winf[..., j]  # the same sum order as the prefill
    return apply_activation(y, activation)


def causal_conv1d_update(x: Tensor, weight: Tensor, state: Tensor, *, activation: str | None = "silu") -> Tensor:
    """One token per sequence: x [N, C], weight [C, W]; `state` [N, C, W-1] is updated in place."""
    window = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [N, C, W]
    y = conv_window(window, weight, activation)
    state.copy_(window[..., 1:])
    return y.to(x.dtype)
