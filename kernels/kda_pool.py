"""KDA over pool-resident states: varlen prefill with checkpoints, in-place decode, and replay.

State pool per KDA layer: [num_slots, H, K, V] fp32; a sequence names its slot. Each op dispatches once
(`backend.kernel_backend`) to its torch reference here or to the Triton kernel in `kda_triton`.

Replay (ReplaySSM): advance a slot's state over saved per-token inputs, the first n of them; it runs the
same per-token code as decode, so on one backend replay and decode agree bit for bit. On CPU decode runs the
fused in-place op of `kda_decode_cpu` where it builds: the torch step's bits, each state read and written once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kernels import kda_decode_cpu as fused_kda
from kernels.backend import kernel_backend
from kernels.kda import KDAGate, kda_gate, kda_read, kda_step, kda_step_, l2norm, seq_bounds
from kernels.kda_chunk import chunk_scan, plan_chunks
from kernels.pool_slots import gather_slots, scatter_slots
from kernels.spec_layout import WindowLayout, pad, unpad, window_layout
from kernels.state_checkpoints import StateCheckpoints, check_num_tokens, check_slots


class StepInputs(NamedTuple):
    """What decode/replay consume per token, after the optional in-kernel preprocessing."""

    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor


def _initial_states(pool: Tensor, slots: Tensor, has_initial_state: Tensor | None) -> Tensor:
    s = gather_slots(pool, slots).float()
    if has_initial_state is None:
        return s
    # where, not a product: a fresh slot may hold anything, NaN included
    return torch.where(has_initial_state.view(-1, 1, 1, 1).bool(), s, torch.zeros((), device=s.device))


def kda_prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    *,
    state_slots: Tensor,
    cu_seqlens: Tensor | None = None,
    has_initial_state: Tensor | None = None,
    checkpoints: StateCheckpoints | None = None,
    scale: float | None = None,
    commit: bool = True,
    chunk_size: int = 64,
    validate: bool = True,
) -> Tensor:
    """Chunked KDA over packed sequences (inputs as `kda.kda_chunked`) with states in `state_pool`.

    Sequence i starts from state_pool[state_slots[i]] (zeros where has_initial_state[i] is False; None = all
    True) and, if `commit`, ends there. Checkpoints are written to their slots. Returns o [T, H, V].
    `validate=False` skips `check_slots` (a host read of the slots): for callers that ran it once per step."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n = 1 if cu_seqlens is None else len(cu_seqlens) - 1
    if len(state_slots) != n:
        raise ValueError(f"{len(state_slots)} state slots for {n} sequences")
    if validate:
        check_slots(state_slots, checkpoints, state_pool.shape[0])
    if kernel_backend(q.device) == "triton":
        from kernels.kda_triton import kda_prefill_triton

        return kda_prefill_triton(
            q, k, v, g, beta, state_pool, state_slots, cu_seqlens, has_initial_state, checkpoints, scale, commit
        )
    bounds = seq_bounds(cu_seqlens, q.shape[0])
    states = _initial_states(state_pool, state_slots, has_initial_state)
    plan = plan_chunks(bounds, chunk_size, checkpoints.pairs() if checkpoints is not None else None, q.device)
    o, ck_states = chunk_scan(q, k, v, g, beta, states, plan, scale)
    if checkpoints is not None and len(checkpoints.slot):
        scatter_slots(state_pool, checkpoints.slot, ck_states)
    if commit:
        scatter_slots(state_pool, state_slots, states)
    return o.to(v.dtype)


def preprocess_step(
    k: Tensor, v: Tensor, g: Tensor, beta: Tensor, gate: KDAGate | None, beta_logits: bool, qk_l2norm: bool
) -> StepInputs:
    """The optional in-kernel preprocessing of one token per sequence, [N, H, ...]."""
    if gate is not None:
        g = kda_gate(g, gate.A_log, gate.dt_bias, gate.lower_bound)
    if beta_logits:
        beta = torch.sigmoid(beta.float())
    return StepInputs(l2norm(k) if qk_l2norm else k, v, g, beta)


def kda_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_slots: Tensor,
    *,
    scale: float | None = None,
    gate: KDAGate | None = None,
    beta_logits: bool = False,
    qk_l2norm: bool = False,
    validate: bool = True,
) -> Tensor:
    """One token per sequence (q, k, g [N, H, K], v [N, H, V], beta [N, H]), state updated in its slot.

    With `gate`, g is the raw gate projection and the decay is computed here; with `beta_logits`, beta is
    sigmoided here; with `qk_l2norm`, q and k are L2-normalised here. Returns o [N, H, V] in v's dtype.
    `validate=False` skips `check_slots`, as for `kda_prefill`."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if validate:
        check_slots(state_slots, None, state_pool.shape[0])
    if kernel_backend(q.device) == "triton":
        from kernels.kda_triton import kda_recurrent_pool_triton

        o = kda_recurrent_pool_triton(
            q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], state_pool, state_slots,
            torch.ones_like(state_slots), scale, gate, beta_logits, qk_l2norm,
        )  # fmt: skip
        return o[:, 0].to(v.dtype)
    step = preprocess_step(k, v, g, beta, gate, beta_logits, qk_l2norm)
    if fused_kda.available() and fused_kda.fusable(state_pool, state_slots):
        # the same bits, each state read and written once
        o = fused_kda.kda_decode_cpu(l2norm(q) if qk_l2norm else q, *step, state_pool, state_slots, scale)
        return o.to(v.dtype)
    s = kda_step_(gather_slots(state_pool, state_slots).float(), *step)  # the gathered copy is ours to update
    scatter_slots(state_pool, state_slots, s)
    return kda_read(s, l2norm(q) if qk_l2norm else q, scale).to(v.dtype)


def kda_replay(
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_slots: Tensor,
    num_tokens: Tensor,
    *,
    gate: KDAGate | None = None,
    beta_logits: bool = False,
    qk_l2norm: bool = False,
    validate: bool = True,
) -> None:
    """Advance each slot's state over the first num_tokens[i] of its saved tokens, in place.

    k, g [N, L, H, K], v [N, L, H, V], beta [N, L, H]: the same per-token inputs decode takes (raw where the
    flags say so); num_tokens [N] int64 in [0, L]. Equals decode over those tokens bit for bit.
    `validate=False` skips `check_slots` and `check_num_tokens` (host reads)."""
    if validate:
        check_slots(state_slots, None, state_pool.shape[0])
        check_num_tokens(num_tokens, k.shape[1])
    if kernel_backend(k.device) == "triton":
        from kernels.kda_triton import kda_recurrent_pool_triton

        kda_recurrent_pool_triton(
            None, k, v, g, beta, state_pool, state_slots, num_tokens, 1.0, gate, beta_logits, qk_l2norm
        )
        return
    counts = num_tokens.tolist()
    if not counts or max(counts) == 0:
        return
    s = gather_slots(state_pool, state_slots).float()  # our copy: updated in place while every row advances
    every = min(counts)
    for t in range(max(counts)):
        step = preprocess_step(k[:, t], v[:, t], g[:, t], beta[:, t], gate, beta_logits, qk_l2norm)
        # the same elementwise ops either way, so the same bits; rows past their count keep their state
        s = kda_step_(s, *step) if t < every else torch.where((num_tokens > t).view(-1, 1, 1, 1),
                                                              kda_step(s, *step), s)
    scatter_slots(state_pool, state_slots, s)


def kda_verify(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_slots: Tensor,
    cu_seqlens: Tensor,
    *,
    scale: float | None = None,
    snapshots: Tensor | None = None,
    snapshot_rows: Tensor | None = None,
    layout: WindowLayout | None = None,
) -> Tensor:
    """A speculative window: each sequence's new tokens (inputs as `kda_decode`, packed by cu_seqlens) run one
    by one from its slot's state, which is NOT written back. Per token this is decode's arithmetic
    (`kda_step`, `kda_read`), so the outputs equal plain decode's and a later `kda_replay` of the same inputs
    ends on exactly the state decode would. With `snapshots` [R, W, H, K, V] (the snapshot baseline) the state
    after window position t of sequence i is also written to snapshots[snapshot_rows[i], t]. Returns o [T, H, V].
    `layout`: the step's `window_layout(cu_seqlens, T)` when the caller has it. Torch on every backend."""
    lay = window_layout(cu_seqlens, q.shape[0]) if layout is None else layout
    o = kda_verify_padded(*(pad(x, lay) for x in (q, k, v, g, beta)), state_pool, state_slots, scale=scale,
                          snapshots=snapshots, snapshot_rows=snapshot_rows)
    return unpad(o, lay)


def kda_verify_padded(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    state_slots: Tensor,
    *,
    scale: float | None = None,
    snapshots: Tensor | None = None,
    snapshot_rows: Tensor | None = None,
) -> Tensor:
    """`kda_verify` over zero-padded windows: q, k, g [N, W, H, K], v [N, W, H, V], beta [N, W, H] -> o
    [N, W, H, V] in v's dtype. Position t of every window is one batched step (elementwise, so a row's bits do
    not depend on its batch-mates); a padded position (zero k, v, beta and log decay) leaves the state as it
    was, and its output is dropped by the caller."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if fused_kda.available() and fused_kda.verify_fusable(state_pool, state_slots, snapshots):
        # the same bits, each state read once and the window run in cache
        o = fused_kda.kda_verify_cpu(q, k, v, g, beta, state_pool, state_slots, scale, snapshots, snapshot_rows)
        return o.to(v.dtype)
    s = gather_slots(state_pool, state_slots).float()
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[1]):
        s = kda_step(s, k[:, t], v[:, t], g[:, t], beta[:, t])
        o[:, t] = kda_read(s, q[:, t], scale)
        if snapshots is not None and snapshot_rows is not None:
            snapshots[:, t].index_copy_(0, snapshot_rows, s)
    return o.to(v.dtype)
