"""Causal conv1d over pool-resident conv states: varlen prefill with checkpoints, one-token decode, replay.

Conv pool per layer: [num_slots, C, W-1] holding each sequence's last W-1 pre-conv inputs (oldest first).
Dispatches once to the torch code here or to `conv1d_triton`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.backend import kernel_backend
from kernels.conv1d import causal_conv1d, causal_conv1d_update, conv_history
from kernels.state_checkpoints import StateCheckpoints, check_num_tokens, check_slots


def _initial(pool: Tensor, slots: Tensor, has_initial_state: Tensor | None) -> Tensor:
    s = pool[slots]
    if has_initial_state is None:
        return s
    return torch.where(has_initial_state.view(-1, 1, 1).bool(), s, torch.zeros((), dtype=s.dtype, device=s.device))


def conv1d_prefill(
    x: Tensor,
    weight: Tensor,
    conv_pool: Tensor,
    *,
    state_slots: Tensor,
    cu_seqlens: Tensor | None = None,
    has_initial_state: Tensor | None = None,
    checkpoints: StateCheckpoints | None = None,
    activation: str | None = "silu",
    commit: bool = True,
) -> Tensor:
    """x [T, C] packed, weight [C, W]. Sequence i's history comes from conv_pool[state_slots[i]] (zeros where
    has_initial_state[i] is False) and, if `commit`, its new conv state goes back there; the conv state after
    each checkpoint's offset goes to the checkpoint's slot. Returns y [T, C]."""
    n = 1 if cu_seqlens is None else len(cu_seqlens) - 1
    if len(state_slots) != n:
        raise ValueError(f"{len(state_slots)} state slots for {n} sequences")
    check_slots(state_slots, checkpoints, conv_pool.shape[0])
    if kernel_backend(x.device) == "triton":
        from kernels.conv1d_triton import conv1d_prefill_triton

        return conv1d_prefill_triton(
            x, weight, conv_pool, state_slots, cu_seqlens, has_initial_state, checkpoints, activation, commit
        )
    init = _initial(conv_pool, state_slots, has_initial_state)
    y, final = causal_conv1d(x, weight, cu_seqlens=cu_seqlens, initial_state=init, activation=activation)
    if checkpoints is not None and len(checkpoints.slot):
        width = weight.shape[-1]
        hist, row, bounds = conv_history(x, cu_seqlens, init, width)
        # the W-1 history rows of sequence s start at bounds[s] + s*(W-1); after p tokens they are shifted by p
        first = torch.tensor(bounds[:-1], device=x.device)[checkpoints.seq] + checkpoints.seq * (width - 1)
        rows = (first + checkpoints.offset)[:, None] + torch.arange(width - 1, device=x.device)
        conv_pool[checkpoints.slot] = hist[rows].transpose(1, 2).to(conv_pool.dtype)
    if commit:
        conv_pool[state_slots] = final.to(conv_pool.dtype)
    return y


def conv1d_decode(
    x: Tensor, weight: Tensor, conv_pool: Tensor, state_slots: Tensor, *, activation: str | None = "silu"
) -> Tensor:
    """One token per sequence, x [N, C]; each slot's conv state shifts by that token in place."""
    check_slots(state_slots, None, conv_pool.shape[0])
    if kernel_backend(x.device) == "triton":
        from kernels.conv1d_triton import conv1d_decode_triton

        return conv1d_decode_triton(x, weight, conv_pool, state_slots, activation)
    state = conv_pool[state_slots]
    y = causal_conv1d_update(x, weight, state, activation=activation)
    conv_pool[state_slots] = state
    return y


def conv1d_replay(x: Tensor, conv_pool: Tensor, state_slots: Tensor, num_tokens: Tensor) -> None:
    """Shift each slot's conv state by the first num_tokens[i] of its saved pre-conv inputs x [N, L, C]."""
    check_slots(state_slots, None, conv_pool.shape[0])
    check_num_tokens(num_tokens, x.shape[1])
    if kernel_backend(x.device) == "triton":
        from kernels.conv1d_triton import conv1d_replay_triton

        conv1d_replay_triton(x, conv_pool, state_slots, num_tokens)
        return
    keep = conv_pool.shape[-1]
    window = torch.cat([conv_pool[state_slots], x.transpose(1, 2).to(conv_pool.dtype)], dim=-1)  # [N, C, W-1+L]
    idx = (num_tokens[:, None] + torch.arange(keep, device=x.device)).view(-1, 1, keep).expand(-1, x.shape[2], -1)
    conv_pool[state_slots] = window.gather(2, idx)
