"""The captured verify step of speculative decoding: the target's forward over every sequence's draft window
(its last sampled token and k drafts) compiled once per (batch-size bucket, window width), as the decode step is
(`decode_graph.py`), for n-gram and MTP speculation (with `with_hidden`, the pre-norm hiddens MTP reads).

- Shapes: B windows of W = k + 1 tokens each, B the smallest bucket >= the step's sequences. A window shorter
  than W (a constrained request drafts nothing, a proposer found fewer drafts) is padded at its end: causal, so
  its real tokens never see the padding, whose KV goes to the scratch KV row and whose logits are dropped. Padding
  rows read and write only the scratch state slot, the scratch KV row and the draft window's scratch row.
- Attention: each window token is one query over its own cached rows (its prefix, the window up to itself):
  `mla_decode_padded`, the decode step's absorbed form, over a [B*W, S] row table.
- The pool and draft-window ops are opaque custom ops (as decode's): the short conv and the KDA layers run their
  window from the live state without writing it (`conv1d_verify_padded`, `kda_verify_padded`) and fill the draft
  window (inputs for ReplaySSM, or per-position snapshots) exactly as the eager backend does.
The eager verify stays the oracle: `tests/runtime/test_verify_graph.py` checks greedy tokens with n-gram and MTP
speculation, compiled against eager.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from kernels import pool_ops_cpu
from kernels.conv1d_pool import conv1d_verify_padded
from kernels.kda_pool import kda_verify_padded
from kernels.opaque_op import opaque_op
from kernels.spec_layout import WindowLayout, window_layout
from radixk3.decode_graph import _CACHES, DecodeGraphs, GraphOutput, PaddedDecodeBackend, Scratch, pad_rows, row_table
from radixk3.forward_batch import ForwardBatch, ForwardMode, HybridCache
from radixk3.model import KimiForCausalLM
from radixk3.spec_window import SpecWindow

# The draft window of each verify graph, by its cache key (as `_CACHES`): state outside the graph.
_WINDOWS: dict[int, SpecWindow] = {}


class PaddedVerify(NamedTuple):
    """One (bucket, width)'s inputs: B windows of W tokens (padding included), tokens packed window by window."""

    input_ids: Tensor  # [B*W] int64
    state_slots: Tensor  # [B] int64
    window_rows: Tensor  # [B] int64, each window's row of the draft window
    kv_slots: Tensor  # [B*W] int64, where each token's latent is stored
    kv_rows: Tensor  # [B*W, S] int64, each token's cached KV rows (its own last), padded with any valid row
    kv_lens: Tensor  # [B*W] int64, valid entries of kv_rows per token


@opaque_op("radixk3::pool_conv_verify")
def pool_conv_verify(cache_key: int, layer: int, x: Tensor, weight: Tensor, slots: Tensor, rows: Tensor) -> Tensor:
    """x [B, W, C]: save the window's conv inputs, then `conv1d_verify_padded` from the live conv state."""
    window = _WINDOWS[cache_key]
    window.save_conv_inputs(layer, rows, x)
    snap = window.snap_conv[layer] if window.mode == "snapshot" else None
    return conv1d_verify_padded(x, weight, _CACHES[cache_key].conv[layer], slots, snapshots=snap,
                                snapshot_rows=rows).contiguous()


@torch.library.register_fake("radixk3::pool_conv_verify")
def _(cache_key: int, layer: int, x: Tensor, weight: Tensor, slots: Tensor, rows: Tensor) -> Tensor:
    return torch.empty_like(x)


@opaque_op("radixk3::pool_kda_verify")
def pool_kda_verify(cache_key: int, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                    slots: Tensor, rows: Tensor) -> Tensor:
    """[B, W, ...] inputs: save them in the draft window, then `kda_verify_padded` from the live state."""
    window = _WINDOWS[cache_key]
    window.save_kda_inputs(layer, rows, k, v, g, beta)
    snap = window.snap_recurrent[layer] if window.mode == "snapshot" else None
    return kda_verify_padded(q, k, v, g, beta, _CACHES[cache_key].recurrent[layer], slots, snapshots=snap,
                             snapshot_rows=rows).contiguous()


@torch.library.register_fake("radixk3::pool_kda_verify")
def _(cache_key: int, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, slots: Tensor,
      rows: Tensor) -> Tensor:
    return torch.empty_like(v)


class PaddedVerifyBackend(PaddedDecodeBackend):
    """The attention backend of a captured verify step: fixed [B, W] windows, no host reads; its attention is the
    decode step's, each window token one query."""

    decode = False
    verify = True

    def __init__(self, cache_key: int, step: PaddedVerify, cpp_ops: bool = False, cpp_window: bool = False) -> None:
        super().__init__(cache_key, step, cpp_ops)  # its kv_slots, kv_rows, kv_lens: one per window token
        self.b = step.state_slots.shape[0]
        self.cpp_window = cpp_window  # the window ops registered in C++ (replay mode: `VerifyGraphs`)

    def _windows(self, x: Tensor) -> Tensor:
        return x.view(self.b, -1, *x.shape[1:])

    def short_conv(self, layer: int, x: Tensor, weight: Tensor) -> Tensor:
        s = self.step
        op = pool_ops_cpu.conv_verify if self.cpp_window else pool_conv_verify
        return op(self.key, layer, self._windows(x), weight, s.state_slots, s.window_rows).flatten(0, 1)

    def kda(self, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        s = self.step
        w = self._windows
        op = pool_ops_cpu.kda_verify if self.cpp_window else pool_kda_verify
        return op(self.key, layer, w(q), w(k), w(v), w(g), w(beta), s.state_slots, s.window_rows).flatten(0, 1)


def padded_verify_logits(model: KimiForCausalLM, cache_key: int, step: PaddedVerify,
                         with_hidden: bool = False, cpp_ops: bool = False, cpp_window: bool = False) -> GraphOutput:
    """The verify forward of `step`'s B windows -> fp32 logits [B*W, V] at every window position."""
    n = step.input_ids.shape[0]
    b = step.state_slots.shape[0]
    cu = torch.arange(0, n + 1, n // b, device=step.input_ids.device)
    batch = ForwardBatch(ForwardMode.VERIFY, step.input_ids, cu, step.kv_lens[:: n // b] - 1, step.state_slots,
                         step.kv_rows, 1, step.kv_slots,
                         attn_backend=PaddedVerifyBackend(cache_key, step, cpp_ops, cpp_window))  # type: ignore[arg-type]
    hidden = model._prenorm_hidden(step.input_ids, cu, batch)
    return GraphOutput(model.lm_head(model.model.norm(hidden)).float(), hidden if with_hidden else None)


class VerifyGraphs(DecodeGraphs):
    """The compiled verify step of one model over one cache and draft window, per batch-size bucket, for windows
    of `width` tokens; `scratch_row` is the draft window's row that padding rows write."""

    kind = "verify"

    def __init__(self, model: KimiForCausalLM, cache: HybridCache, scratch: Scratch, buckets: Sequence[int],
                 window: SpecWindow, scratch_row: int, with_hidden: bool = False, cpp_wrapper: bool = False) -> None:
        super().__init__(model, cache, scratch, buckets, with_hidden, cpp_wrapper)
        _WINDOWS[self.key] = window
        weakref.finalize(self, _WINDOWS.pop, self.key, None).atexit = False
        self.width = window.width
        self.scratch_row = scratch_row
        # ReplaySSM's window: the conv and KDA window ops registered in C++ too (the snapshot baseline keeps the
        # Python ops, which write per-position snapshots).
        self.cpp_window = self.cpp_ops and window.mode == "replay"
        if self.cpp_window:
            pool_ops_cpu.register_window(self.key, window.x, window.k, window.v, window.g, window.beta)
            # the commit after acceptance too (eager verify steps' windows included: the same rings)
            window.fused_commit = functools.partial(pool_ops_cpu.window_commit, self.key)

    def _forward(self, step: PaddedVerify) -> GraphOutput:  # type: ignore[override]
        return padded_verify_logits(self.model, self.key, step, self.with_hidden, self.cpp_ops, self.cpp_window)

    def _scratch_step(self, b: int, kv_len: int) -> PaddedVerify:  # type: ignore[override]
        dev, s, n = self.device, self.scratch, b * self.width
        full = torch.zeros(n, dtype=torch.int64, device=dev)
        return PaddedVerify(full, full[:b] + s.state_slot, full[:b] + self.scratch_row, full + s.kv_row,
                            torch.full((n, self.kv_width(kv_len)), s.kv_row, dtype=torch.int64, device=dev),
                            full + kv_len)

    def supports(self, batch: ForwardBatch) -> bool:
        """A verify step whose windows fit `width` and whose sequences fit a bucket."""
        spec = batch.spec
        return (batch.mode is ForwardMode.VERIFY and spec is not None and spec.window.width == self.width
                and self.bucket(batch.num_seqs) is not None
                and int((batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).max()) <= self.width)

    def run(self, batch: ForwardBatch, prenorm: list[Tensor] | None = None) -> Tensor:
        """Logits [T, V] fp32 for the packed window tokens (then `batch.logits_index` of them), as the eager
        `model.forward_batch(batch, cache, prenorm=prenorm).float()` gives them."""
        n = batch.num_seqs
        b = self.bucket(n)
        assert b is not None and batch.spec is not None, "a step the verify graphs do not cover"
        self.validate(batch.state_slots, batch.checkpoints, batch.kv_slots)
        self.replays += 1
        lay = batch.spec.layout or window_layout(batch.cu_seqlens, int(batch.input_ids.numel()))
        # Every window `width` tokens and no padding window (batch 1, k drafts each): packed is padded.
        whole = n == b and lay.full and lay.width == self.width
        flat = None if whole else lay.seq * self.width + lay.off  # each token's row of the padded [b * W]
        out = self.call(self._padded_verify(batch, b, lay, flat))
        if prenorm is not None:
            assert out.hidden is not None, "hiddens from graphs captured without them"
            prenorm.append(out.hidden if flat is None else out.hidden[flat])
        logits = out.logits if flat is None else out.logits[flat]
        return logits if batch.logits_index is None else logits[batch.logits_index]

    def _padded_verify(self, batch: ForwardBatch, b: int, lay: WindowLayout, flat: Tensor | None) -> PaddedVerify:
        """The real windows' tensors at rows `flat` (seq * W + offset) of [b * W], the rest on the scratch slots;
        `flat` None: the windows fill every row."""
        n, w, dev, s = batch.num_seqs, self.width, self.device, self.scratch
        spec = batch.spec
        assert spec is not None
        width = self.kv_width(int(batch.seq_lens.max()))
        if flat is None:
            kv_lens = batch.prefix_lens[lay.seq] + lay.off + 1
            rows = row_table(batch.block_table[lay.seq], batch.page_size, kv_lens, width)
            return PaddedVerify(batch.input_ids, batch.state_slots, spec.rows, batch.kv_slots, rows, kv_lens)
        kv_lens = torch.ones(b * w, dtype=torch.int64, device=dev)
        kv_lens[flat] = batch.prefix_lens[lay.seq] + lay.off + 1
        seq_of = torch.arange(b * w, device=dev) // w
        table = batch.block_table[seq_of.clamp(max=n - 1)]  # rows of padding windows are masked below
        rows = row_table(table, batch.page_size, kv_lens, width)
        real = torch.zeros(b * w, dtype=torch.bool, device=dev)
        real[flat] = True
        rows = torch.where(real[:, None], rows, s.kv_row)
        ids = torch.zeros(b * w, dtype=torch.int64, device=dev)
        ids[flat] = batch.input_ids
        kv_slots = torch.full((b * w,), s.kv_row, dtype=torch.int64, device=dev)
        kv_slots[flat] = batch.kv_slots
        return PaddedVerify(ids, pad_rows(batch.state_slots, b, s.state_slot), pad_rows(spec.rows, b, self.scratch_row),
                            kv_slots, rows, kv_lens)
