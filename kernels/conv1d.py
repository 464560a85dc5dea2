"""Depthwise causal conv1d (the KDA short conv) with per-sequence conv state.

As PyTorch's conv1d (cross-correlation) with W-1 zeros of left padding: y_t[c] = sum_j w[c, j] x_{t-W+1+j}[c],
so w[c, W-1] multiplies the current token. The conv state is the last W-1 *pre-conv* inputs of a sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _act(y: Tensor, activation: str | None) -> Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported activation {activation!r}")


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    *,
    cu_seqlens: Tensor | None = None,
    initial_state: Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[Tensor, Tensor]:
    """x [T, C], weight [C, W], initial_state [N, C, W-1] or None -> (y [T, C], final_state [N, C, W-1])."""
    t, c = x.shape
    w = weight.shape[-1]
    bounds = [0, t] if cu_seqlens is None else cu_seqlens.tolist()
    n = len(bounds) - 1
    ys, finals = [], []
    for i in range(n):
        seg = x[bounds[i] : bounds[i + 1]].t()  # [C, L]
        left = (
            initial_state[i].to(x.dtype)
            if initial_state is not None
            else torch.zeros(c, w - 1, dtype=x.dtype, device=x.device)
        )
        padded = torch.cat([left, seg], dim=1)  # [C, W-1+L]
        y = F.conv1d(padded.unsqueeze(0), weight.unsqueeze(1).to(x.dtype), groups=c)[0]
        ys.append(y.t())
        finals.append(padded[:, padded.shape[1] - (w - 1) :])
    return _act(torch.cat(ys), activation), torch.stack(finals)


def causal_conv1d_update(
    x: Tensor, weight: Tensor, state: Tensor, *, activation: str | None = "silu"
) -> Tensor:
    """One token per sequence: x [N, C]; `state` [N, C, W-1] is updated in place."""
    window = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [N, C, W]
    y = (window * weight.to(x.dtype)).sum(-1)
    state.copy_(window[..., 1:])
    return _act(y, activation)
