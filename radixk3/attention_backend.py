"""The attention backend: the only code that touches the cache tensors during a cached step.

Model layers hand it their projected inputs; it runs the pool-resident kernels of `kernels/` (torch on CPU,
Triton on CUDA, dispatched inside each op) in place on the cache's per-layer views, addressing KV through the
batch's page table and KDA state through its state slots:
- short conv: prefill over packed chunks from each slot's conv state (decode: the one-token update);
- KDA: chunked prefill from each slot's state, with states emitted at the batch's checkpoints (decode: the
  fused recurrent step, in place);
- MLA: store the new tokens' latent at their slots, then attend over the paged latent (decode: the
  weight-absorbed form).
Verify (speculative decoding): conv and KDA run each sequence's window token by token from its live state with
decode's arithmetic and leave the state as it was; the window (`batch.spec`) keeps what the commit after
acceptance needs (`spec_window.py`). MLA stores every window token's latent: the rejected ones are simply
never read (the scheduler truncates the sequence).
One backend is built per step (`for_batch`), so what every layer shares is computed once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kernels.backend import kernel_backend
from kernels.conv1d_pool import conv1d_decode, conv1d_prefill, conv1d_verify_padded
from kernels.kda_pool import kda_decode, kda_prefill, kda_verify_padded
from kernels.mla import mla_attention
from kernels.mla_paged import check_paged, check_store_slots, mla_paged_decode, mla_paged_prefill, mla_store
from kernels.paged_kv import PagedKV, sequence_slots
from kernels.spec_layout import pad, unpad, window_layout
from kernels.state_checkpoints import StateCheckpoints, check_slots
from radixk3.forward_batch import ForwardBatch, ForwardMode, HybridCache

SlotPairs = tuple[Tensor, Tensor]  # (source slots, destination slots)


def decode_checkpoints(state_slots: Tensor, ck: StateCheckpoints) -> tuple[SlotPairs | None, SlotPairs | None]:
    """A decode step's checkpoints as slot copies: a decode step has one token, so a checkpoint is the state
    before it (offset 0: copied before the step) or after it (offset 1: copied after); None where there are none."""
    offs = ck.offset
    if bool(((offs != 0) & (offs != 1)).any()):
        raise ValueError("a decode step's checkpoints must be at offset 0 or 1")

    def pairs(offset: int) -> SlotPairs | None:
        keep = offs == offset
        return (state_slots[ck.seq[keep]], ck.slot[keep]) if bool(keep.any()) else None

    return pairs(0), pairs(1)


def copy_states(pool: Tensor, pairs: SlotPairs | None) -> None:
    """Copy each source slot's state to its destination slot (`decode_checkpoints`' pairs)."""
    if pairs is not None:
        src, dst = pairs
        pool[dst] = pool[src]


class AttentionBackend:
    def __init__(self, batch: ForwardBatch, cache: HybridCache) -> None:
        self.batch = batch
        self.cache = cache
        self.decode = batch.mode is ForwardMode.DECODE
        self.verify = batch.mode is ForwardMode.VERIFY
        if self.verify:
            if batch.spec is None:
                raise ValueError("a verify batch needs its draft window (batch.spec)")
            if not bool((batch.prefix_lens > 0).all()):
                raise ValueError("a verify window starts after a cached prefix: every prefix must be non-empty")
            lay = batch.spec.layout
            self._lay = lay if lay is not None else window_layout(batch.cu_seqlens, int(batch.input_ids.numel()))
        self.has_state = batch.prefix_lens > 0
        self.paged = PagedKV(batch.block_table, batch.seq_lens, batch.page_size)
        self._kv_rows: Tensor | None = None  # every cached token's KV slot (torch MLA), built by the first layer
        ck = batch.checkpoints
        self.checkpoints = ck if ck is not None and len(ck.slot) else None
        if self.verify and self.checkpoints is not None:
            raise ValueError("a verify step takes no checkpoints: its tokens are not committed yet")
        self._validate()
        if self.decode and self.checkpoints is not None:
            self._ck_before, self._ck_after = decode_checkpoints(batch.state_slots, self.checkpoints)

    def _validate(self) -> None:
        """The kernels' argument checks read tensors back to the host: run them once per step, not per layer."""
        b, c = self.batch, self.cache
        if c.recurrent:
            check_slots(b.state_slots, self.checkpoints, c.recurrent[0].shape[0])
        if c.latent:
            check_store_slots(b.kv_slots, c.latent[0].shape[0])
            check_paged(self.paged, b.cu_seqlens[1:] - b.cu_seqlens[:-1])

    def _decode_step(self, pool: Tensor, step: Callable[[], Tensor]) -> Tensor:
        """Run a decode op with the checkpoints before and after it copied slot to slot."""
        if self.checkpoints is not None:
            copy_states(pool, self._ck_before)
        out = step()
        if self.checkpoints is not None:
            copy_states(pool, self._ck_after)
        return out

    def short_conv(self, layer: int, x: Tensor, weight: Tensor) -> Tensor:
        """Causal depthwise conv + SiLU of KDA layer `layer` over the new tokens x [T, C]."""
        pool = self.cache.conv[layer]
        b = self.batch
        if self.decode:
            return self._decode_step(pool, lambda: conv1d_decode(x, weight, pool, b.state_slots, validate=False))
        if self.verify:
            w = b.spec
            assert w is not None
            snap = w.window.snap_conv[layer] if w.window.mode == "snapshot" else None
            xp = pad(x, self._lay)  # padded once: the ring and the window conv share it
            w.window.save_conv_inputs(layer, w.rows, xp)
            y = conv1d_verify_padded(xp, weight, pool, b.state_slots, snapshots=snap, snapshot_rows=w.rows)
            return unpad(y, self._lay)
        return conv1d_prefill(x, weight, pool, state_slots=b.state_slots, cu_seqlens=b.cu_seqlens,
                              has_initial_state=self.has_state, checkpoints=self.checkpoints, validate=False)

    def kda(self, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        """The gated delta rule of KDA layer `layer` (q, k L2-normalised; g the log decay) -> o [T, H, V]."""
        pool = self.cache.recurrent[layer]
        b = self.batch
        if self.decode:
            return self._decode_step(pool, lambda: kda_decode(q, k, v, g, beta, pool, b.state_slots, validate=False))
        if self.verify:
            w = b.spec
            assert w is not None
            snap = w.window.snap_recurrent[layer] if w.window.mode == "snapshot" else None
            qp, kp, vp, gp, bp = (pad(t, self._lay) for t in (q, k, v, g, beta))
            w.window.save_kda_inputs(layer, w.rows, kp, vp, gp, bp)
            o = kda_verify_padded(qp, kp, vp, gp, bp, pool, b.state_slots, snapshots=snap, snapshot_rows=w.rows)
            return unpad(o, self._lay)
        return kda_prefill(q, k, v, g, beta, pool, state_slots=b.state_slots, cu_seqlens=b.cu_seqlens,
                           has_initial_state=self.has_state, checkpoints=self.checkpoints, validate=False)

    def mla(self, layer: int, q_nope: Tensor, q_pe: Tensor, latent: Tensor, kv_b_weight: Tensor,
            scale: float) -> Tensor:
        """Store the new tokens' latent of MLA layer `layer`, then attend over each sequence's paged KV."""
        buf = self.cache.latent[layer]
        mla_store(buf, self.batch.kv_slots, latent, validate=False)
        if self._kv_rows is None and kernel_backend(buf.device) != "triton":
            self._kv_rows = sequence_slots(self.paged)  # the same for every MLA layer of the step
        if self.decode:
            return mla_paged_decode(q_nope, q_pe, buf, kv_b_weight, self.paged, scale=scale, validate=False,
                                    kv_rows=self._kv_rows)
        if self.verify and self._kv_rows is not None:
            # A window's few queries each stand where a decode token would: decode's weight-absorbed form
            # (scores against the latent), not prefill's, which expands K and V for the whole context.
            cu_kv = torch.cat([self.paged.kv_lens.new_zeros(1), torch.cumsum(self.paged.kv_lens, 0)])
            return mla_attention(q_nope, q_pe, buf, kv_b_weight, cu_q=self.batch.cu_seqlens, cu_kv=cu_kv,
                                 scale=scale, absorbed=True, kv_rows=self._kv_rows)
        return mla_paged_prefill(q_nope, q_pe, buf, kv_b_weight, self.paged, cu_q=self.batch.cu_seqlens,
                                 scale=scale, validate=False, kv_rows=self._kv_rows)
