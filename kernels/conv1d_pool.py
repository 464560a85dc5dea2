"""Causal conv1d over pool-resident conv states: varlen prefill with checkpoints, one-token decode, replay.

Conv pool per layer: [num_slots, C, W-1] holding each sequence's last W-1 pre-conv inputs (oldest first).
Dispatches once to the torch code here or to `conv1d_triton`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import conv1d_cpu as fused_conv
from kernels.backend import kernel_backend
from kernels.conv1d import apply_activation, conv_from_history, conv_history, conv_window, history_states
from kernels.pool_slots import gather_slots, scatter_slots
from kernels.spec_layout import WindowLayout, pad, unpad, window_layout
from kernels.state_checkpoints import StateCheckpoints, check_num_tokens, check_slots


def _initial(pool: Tensor, slots: Tensor, has_initial_state: Tensor | None) -> Tensor:
    s = gather_slots(pool, slots)
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
    validate: bool = True,
) -> Tensor:
    """x [T, C] packed, weight [C, W]. Sequence i's history comes from conv_pool[state_slots[i]] (zeros where
    has_initial_state[i] is False) and, if `commit`, its new conv state goes back there; the conv state after
    each checkpoint's offset goes to the checkpoint's slot. Returns y [T, C].
    `validate=False` skips `check_slots` (a host read of the slots): for callers that ran it once per step."""
    n = 1 if cu_seqlens is None else len(cu_seqlens) - 1
    if len(state_slots) != n:
        raise ValueError(f"{len(state_slots)} state slots for {n} sequences")
    if validate:
        check_slots(state_slots, checkpoints, conv_pool.shape[0])
    if kernel_backend(x.device) == "triton":
        from kernels.conv1d_triton import conv1d_prefill_triton

        return conv1d_prefill_triton(
            x, weight, conv_pool, state_slots, cu_seqlens, has_initial_state, checkpoints, activation, commit
        )
    width = weight.shape[-1]
    hist, row, bounds = conv_history(x, cu_seqlens, _initial(conv_pool, state_slots, has_initial_state), width)
    if fused_conv.available() and fused_conv.fusable(x, conv_pool):  # the same bits, each input read in place
        y = apply_activation(fused_conv.conv_from_history_cpu(hist, row, weight), activation).to(x.dtype)
    else:
        y = conv_from_history(hist, row, weight, activation).to(x.dtype)
    # the W-1 history rows of sequence s start at bounds[s] + s*(W-1); after p tokens they are shifted by p
    b = torch.tensor(bounds, dtype=torch.int64, device=x.device)
    first = b[:-1] + torch.arange(n, device=x.device) * (width - 1)
    if checkpoints is not None and len(checkpoints.slot):
        rows = first[checkpoints.seq] + checkpoints.offset
        scatter_slots(conv_pool, checkpoints.slot, history_states(hist, rows, width))
    if commit:
        scatter_slots(conv_pool, state_slots, history_states(hist, first + b.diff(), width))
    return y


def conv1d_decode(
    x: Tensor,
    weight: Tensor,
    conv_pool: Tensor,
    state_slots: Tensor,
    *,
    activation: str | None = "silu",
    validate: bool = True,
) -> Tensor:
    """One token per sequence, x [N, C]; each slot's conv state shifts by that token in place.
    `validate=False` skips `check_slots`."""
    if validate:
        check_slots(state_slots, None, conv_pool.shape[0])
    if kernel_backend(x.device) == "triton":
        from kernels.conv1d_triton import conv1d_decode_triton

        return conv1d_decode_triton(x, weight, conv_pool, state_slots, activation)
    if fused_conv.available() and fused_conv.fusable(x, conv_pool):  # the same bits, each state touched once
        return apply_activation(fused_conv.conv1d_cpu(x, weight, conv_pool, state_slots), activation).to(x.dtype)
    window = torch.cat([gather_slots(conv_pool, state_slots).to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [N, C, W]
    y = conv_window(window, weight, activation)
    scatter_slots(conv_pool, state_slots, window[..., 1:])
    return y.to(x.dtype)


def conv1d_replay(
    x: Tensor, conv_pool: Tensor, state_slots: Tensor, num_tokens: Tensor, *, validate: bool = True
) -> None:
    """Shift each slot's conv state by the first num_tokens[i] of its saved pre-conv inputs x [N, L, C].
    `validate=False` skips `check_slots` and `check_num_tokens`."""
    if validate:
        check_slots(state_slots, None, conv_pool.shape[0])
        check_num_tokens(num_tokens, x.shape[1])
    if kernel_backend(x.device) == "triton":
        from kernels.conv1d_triton import conv1d_replay_triton

        conv1d_replay_triton(x, conv_pool, state_slots, num_tokens)
        return
    keep = conv_pool.shape[-1]
    window = torch.cat([gather_slots(conv_pool, state_slots), x.transpose(1, 2).to(conv_pool.dtype)], dim=-1)
    idx = (num_tokens[:, None] + torch.arange(keep, device=x.device)).view(-1, 1, keep).expand(-1, x.shape[2], -1)
    scatter_slots(conv_pool, state_slots, window.gather(2, idx))  # window: [N, C, W-1+L]


def conv1d_verify(
    x: Tensor,
    weight: Tensor,
    conv_pool: Tensor,
    state_slots: Tensor,
    cu_seqlens: Tensor,
    *,
    activation: str | None = "silu",
    snapshots: Tensor | None = None,
    snapshot_rows: Tensor | None = None,
    layout: WindowLayout | None = None,
) -> Tensor:
    """A speculative window: each sequence's new tokens (x [T, C] packed by cu_seqlens) convolved from its
    slot's conv state, which is NOT written back; each token's window is built and reduced exactly as
    `conv1d_decode` does, so the outputs equal plain decode's. With `snapshots` [R, W, C, width-1] the conv
    state after window position t of sequence i is also written to snapshots[snapshot_rows[i], t].
    `layout`: the step's `window_layout(cu_seqlens, T)` when the caller has it. Returns y [T, C]. Torch on
    every backend."""
    lay = window_layout(cu_seqlens, x.shape[0]) if layout is None else layout
    y = conv1d_verify_padded(pad(x, lay), weight, conv_pool, state_slots, activation=activation,
                             snapshots=snapshots, snapshot_rows=snapshot_rows)
    return unpad(y, lay)


def conv1d_verify_padded(
    x: Tensor,
    weight: Tensor,
    conv_pool: Tensor,
    state_slots: Tensor,
    *,
    activation: str | None = "silu",
    snapshots: Tensor | None = None,
    snapshot_rows: Tensor | None = None,
) -> Tensor:
    """`conv1d_verify` over zero-padded windows x [N, L, C] -> y [N, L, C] (padded positions: dropped by the
    caller). Every position's [C, width] window is reduced as decode reduces its one window."""
    if snapshots is None and fused_conv.available() and fused_conv.fusable(x, conv_pool):  # the same bits
        return apply_activation(fused_conv.conv1d_verify_cpu(x, weight, conv_pool, state_slots), activation).to(x.dtype)
    width = weight.shape[-1]
    n, length, c = x.shape
    hist = gather_slots(conv_pool, state_slots).to(x.dtype)  # [N, C, W-1]
    full = torch.cat([hist, x.transpose(1, 2)], dim=-1)  # [N, C, W-1+L]
    windows = full.unfold(-1, width, 1).transpose(1, 2)  # [N, L, C, W]: window t ends at token t
    y = conv_window(windows.reshape(n * length, c, width), weight, activation)  # contiguous, as decode's
    if snapshots is not None and snapshot_rows is not None:
        snapshots[:, :length].index_copy_(0, snapshot_rows, windows[..., 1:].to(snapshots.dtype))
    return y.to(x.dtype).view(n, length, c)
