"""The draft window of speculative decoding over the KDA layers: ReplaySSM, or the snapshot baseline.

A verify step runs each sequence's window (its last sampled token and up to k drafts) from its live KDA state
without writing that state back (`kernels.kda_pool.kda_verify`, `kernels.conv1d_pool.conv1d_verify`).
- ReplaySSM ("replay"): every KDA layer saves the per-token inputs its recurrence consumed (post-conv k, v, the
  decay g and beta: what decode's kernel takes) and the short conv's pre-conv inputs in a small ring per
  page-table row. Once the accepted length a is known, `commit` replays the first a+1 of them from the untouched
  live state (`kda_replay` / `conv1d_replay`, the decode arithmetic, so the state is bit for bit what plain
  decode of those tokens leaves) and nothing else: rejection is a cursor move.
- Snapshot ("snapshot"): every layer writes the whole recurrent and conv state after each window position into
  per-row snapshot slots; `commit` copies the accepted one into the live slot. (k+1) states per row, against
  (k+1) tokens of inputs: the memory ReplaySSM saves (`PoolLayout.spec_window_bytes`).
The window's tensors are allocated once, for every row, when the engine starts (their bytes are taken from the
pool budget: `runtime.pool_layout.spec_scratch_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from kernels.conv1d_pool import conv1d_decode, conv1d_replay
from kernels.kda_pool import kda_decode, kda_replay
from kernels.pool_slots import scatter_slots
from kernels.spec_layout import WindowLayout
from radixk3.config import ModelConfig
from radixk3.parallel import parallel_state

SPEC_STATE_MODES = ("replay", "snapshot")


class WindowRows(NamedTuple):
    """The window rows (page-table rows) of a verify batch's sequences, [N] int64, and the window itself;
    `layout` the step's packed <-> padded mapping when the caller has it (else the backend derives it)."""

    window: SpecWindow
    rows: Tensor
    layout: WindowLayout | None = None


@dataclass
class SpecWindow:
    mode: str
    width: int  # k + 1 tokens per row
    # replay: per KDA layer, per row and window position
    k: list[Tensor]  # [R, W, H, D] model dtype (L2-normalised)
    v: list[Tensor]  # [R, W, H, D] model dtype
    g: list[Tensor]  # [R, W, H, D] fp32 log decay
    beta: list[Tensor]  # [R, W, H] fp32
    x: list[Tensor]  # [R, W, 3*H*D] model dtype: the short conv's inputs
    # snapshot: per KDA layer, the state after each window position
    snap_recurrent: list[Tensor]  # [R, W, H, D, D] fp32
    snap_conv: list[Tensor]  # [R, W, 3*H*D, conv_kernel-1] model dtype
    # replay: the whole commit in one call, where the pools and rings are registered with the C++ CPU ops
    # (`VerifyGraphs` sets it: `kernels.pool_ops_cpu.window_commit` on its cache key); None: the torch path
    fused_commit: Callable[[Tensor, Tensor, Tensor], None] | None = None

    @classmethod
    def allocate(cls, cfg: ModelConfig, mode: str, rows: int, width: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", record_inputs: bool = False) -> SpecWindow:
        """`record_inputs`: keep the per-token inputs in snapshot mode too (for `check_committed_states`)."""
        if mode not in SPEC_STATE_MODES:
            raise ValueError(f"spec state mode must be one of {SPEC_STATE_MODES}, got {mode!r}")
        tp = parallel_state().attn_tp_size  # the window holds this rank's KDA heads, as its pool part does
        h, d, c, n = cfg.kda_num_heads // tp, cfg.kda_head_dim, cfg.conv_dim // tp, cfg.num_kda_layers

        def each(shape: tuple[int, ...], dt: torch.dtype, on: bool) -> list[Tensor]:
            return [torch.zeros(rows, width, *shape, dtype=dt, device=device) for _ in range(n)] if on else []

        replay, snap = mode == "replay" or record_inputs, mode == "snapshot"
        w = cfg.conv_kernel_size - 1
        return cls(
            mode, width,
            k=each((h, d), dtype, replay), v=each((h, d), dtype, replay), g=each((h, d), torch.float32, replay),
            beta=each((h,), torch.float32, replay), x=each((c,), dtype, replay),
            snap_recurrent=each((h, d, d), torch.float32, snap), snap_conv=each((c, w), dtype, snap),
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        tensors = self.k + self.v + self.g + self.beta + self.x + self.snap_recurrent + self.snap_conv
        return sum(t.numel() * t.element_size() for t in tensors)

    # --- filled by the attention backend during the verify forward -------------------------------------------
    # Inputs arrive padded, [N, L, ...] with L <= width: one whole-row copy per tensor into the rows' ring.
    def save_conv_inputs(self, layer: int, rows: Tensor, x: Tensor) -> None:
        if self.x:
            self.x[layer][:, : x.shape[1]].index_copy_(0, rows, x)

    def save_kda_inputs(self, layer: int, rows: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> None:
        if self.k:
            length = k.shape[1]
            self.k[layer][:, :length].index_copy_(0, rows, k)
            self.v[layer][:, :length].index_copy_(0, rows, v)
            self.g[layer][:, :length].index_copy_(0, rows, g.float())
            self.beta[layer][:, :length].index_copy_(0, rows, beta.float())

    # --- after acceptance --------------------------------------------------------------------------------
    def commit(self, recurrent: list[Tensor], conv: list[Tensor], state_slots: Tensor, rows: Tensor,
               num_tokens: Tensor) -> None:
        """Advance each sequence's live state by the first num_tokens[i] (>= 1) tokens of its window."""
        if self.fused_commit is not None and self.mode == "replay":
            self.fused_commit(state_slots, rows, num_tokens)
            return
        longest = int(num_tokens.max()) if num_tokens.numel() else 0
        for layer in range(len(recurrent)):
            if self.mode == "replay":
                # only the positions some row commits are read back
                k, v, g, b, x = (t[layer][:, :longest].index_select(0, rows)
                                 for t in (self.k, self.v, self.g, self.beta, self.x))
                kda_replay(k, v, g, b, recurrent[layer], state_slots, num_tokens, validate=False)
                conv1d_replay(x, conv[layer], state_slots, num_tokens, validate=False)
            else:
                last = num_tokens - 1
                scatter_slots(recurrent[layer], state_slots, self.snap_recurrent[layer][rows, last])
                scatter_slots(conv[layer], state_slots, self.snap_conv[layer][rows, last])


def check_committed_states(window: SpecWindow, before: tuple[list[Tensor], list[Tensor]],
                           recurrent: list[Tensor], conv: list[Tensor], state_slots: Tensor, rows: Tensor,
                           num_tokens: Tensor) -> None:
    """The state-parity hook: after `commit`, each sequence's live recurrent and conv state must equal, bit for
    bit, what plain decode (`kda_decode`, `conv1d_decode`) of its committed tokens' inputs leaves, starting from
    `before` (the states gathered before the verify forward). Needs the inputs: a replay window, or a snapshot
    window allocated with them (`allocate(..., record_inputs=True)`). Raises AssertionError naming the layer."""
    n = state_slots.numel()
    scratch = torch.arange(n, device=state_slots.device)
    for layer in range(len(recurrent)):
        rec = before[0][layer].clone()
        cv = before[1][layer].clone()
        k, v, g, b, x = (t[layer][rows] for t in (window.k, window.v, window.g, window.beta, window.x))
        dummy_weight = torch.zeros(cv.shape[1], cv.shape[2] + 1, dtype=x.dtype, device=x.device)
        for t in range(int(num_tokens.max())):
            go = (num_tokens > t).nonzero().squeeze(1)
            if go.numel() == 0:
                break
            kda_decode(k[go, t], k[go, t], v[go, t], g[go, t], b[go, t], rec, scratch[go], validate=False)
            conv1d_decode(x[go, t], dummy_weight, cv, scratch[go], validate=False)
        live_rec = recurrent[layer].index_select(0, state_slots)
        live_conv = conv[layer].index_select(0, state_slots)
        if not torch.equal(live_rec, rec):
            raise AssertionError(f"KDA layer {layer}: recurrent state after commit differs from plain decode")
        if not torch.equal(live_conv, cv):
            raise AssertionError(f"KDA layer {layer}: conv state after commit differs from plain decode")
