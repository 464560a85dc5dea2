"""Causal depthwise conv1d with conv state: prefill vs an independent loop, split prefill, one-token update."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.conv1d import causal_conv1d, causal_conv1d_update

C, W = 6, 4


def reference(x: torch.Tensor, w: torch.Tensor, init: torch.Tensor, act: str | None) -> torch.Tensor:
    """One sequence, the definition: y_t[c] = sum_j w[c, j] x_{t-W+1+j}[c], history from `init` [C, W-1]."""
    hist = torch.cat([init.t(), x])  # [W-1+L, C]
    y = torch.stack([(hist[t : t + W] * w.t()).sum(0) for t in range(x.shape[0])]) if len(x) else x
    return F.silu(y) if act == "silu" else y


def data(lens: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), C, generator=gen)
    w = torch.randn(C, W, generator=gen)
    init = torch.randn(len(lens), C, W - 1, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    return x, w, init, cu


@pytest.mark.parametrize("act", ["silu", None])
def test_varlen_prefill_matches_definition(act: str | None) -> None:
    lens = [1, 2, 3, 7, 20]
    x, w, init, cu = data(lens, 0)
    y, final = causal_conv1d(x, w, cu_seqlens=cu, initial_state=init, activation=act)
    b = cu.tolist()
    for i in range(len(lens)):
        seg = x[b[i] : b[i + 1]]
        torch.testing.assert_close(y[b[i] : b[i + 1]], reference(seg, w, init[i], act), rtol=0, atol=1e-6)
        hist = torch.cat([init[i].t(), seg])  # the last W-1 inputs, the initial state filling in on the left
        torch.testing.assert_close(final[i], hist[-(W - 1) :].t(), rtol=0, atol=0)


def test_no_initial_state_is_zeros() -> None:
    x, w, _, _ = data([10], 1)
    y, final = causal_conv1d(x, w)
    y0, final0 = causal_conv1d(x, w, initial_state=torch.zeros(1, C, W - 1))
    torch.testing.assert_close(y, y0, rtol=0, atol=0)
    torch.testing.assert_close(final, final0, rtol=0, atol=0)
    short, fin = causal_conv1d(x[:2], w)
    assert torch.equal(fin[0, :, 0], torch.zeros(C)) and torch.equal(fin[0, :, 1:], x[:2].t())


@pytest.mark.parametrize("cut", [0, 1, 2, 3, 5, 12])
def test_two_pieces_with_carried_state_equal_one(cut: int) -> None:
    x, w, init, _ = data([12], 2)
    y, final = causal_conv1d(x, w, initial_state=init)
    y1, mid = causal_conv1d(x[:cut], w, initial_state=init)
    y2, final2 = causal_conv1d(x[cut:], w, initial_state=mid)
    torch.testing.assert_close(torch.cat([y1, y2]), y, rtol=0, atol=1e-6)
    torch.testing.assert_close(final2, final, rtol=0, atol=0)


def test_update_equals_prefill() -> None:
    lens = [6, 6, 6]
    x, w, init, cu = data(lens, 3)
    y, final = causal_conv1d(x, w, cu_seqlens=cu, initial_state=init)
    state = init.clone()
    for t in range(6):
        rows = [i * 6 + t for i in range(3)]
        yt = causal_conv1d_update(x[rows], w, state)
        torch.testing.assert_close(yt, y[rows], rtol=0, atol=1e-6)
    torch.testing.assert_close(state, final, rtol=0, atol=0)
