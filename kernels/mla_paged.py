"""MLA over a paged latent KV buffer: the store of new latent rows, prefill and decode attention.

Per MLA layer the buffer is [num_kv_slots, R + Dr] (c_kv already RMS-normalised | k_pe, unrotated: NoPE).
A page table maps sequence positions to slots (`paged_kv`). Sequence i holds kv_lens[i] cached tokens (its
prefix and this step's new tokens, stored first); its queries are its last q_len tokens, causal in that alignment.
Torch: `mla.mla_attention` gathers each group's rows from the buffer (prefill expanded, decode absorbed).
Triton: one absorbed-form kernel (MQA over the latent) for both, in `mla_triton`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.backend import kernel_backend
from kernels.mla import mla_attention
from kernels.paged_kv import PagedKV, sequence_slots


def check_store_slots(slots: Tensor, num_slots: int | None = None) -> None:
    """`mla_store`'s check: no slot twice (and, given num_slots, each in range). A host read of the slots (a
    device sync on a GPU); every MLA layer of a step stores to the same slots, so a caller may run it once
    per step and pass `validate=False` to `mla_store`."""
    values = slots.tolist()
    if len(set(values)) != len(values):
        raise ValueError("mla_store: slots repeat")
    if num_slots is not None and any(not 0 <= s < num_slots for s in values):
        raise ValueError(f"mla_store: a slot lies outside the buffer of {num_slots} rows")


def mla_store(latent_buffer: Tensor, slots: Tensor, latent: Tensor, *, validate: bool = True) -> None:
    """latent_buffer[slots[t]] = latent[t], in place (latent [T, R+Dr], cast to the buffer's dtype).
    `validate=False` skips `check_store_slots`."""
    if validate:
        check_store_slots(slots, latent_buffer.shape[0])
    if kernel_backend(latent.device) == "triton":
        from kernels.mla_triton import mla_store_triton

        mla_store_triton(latent_buffer, slots, latent)
        return
    latent_buffer[slots] = latent.to(latent_buffer.dtype)  # index_put: cheaper than index_copy_ for short rows


def check_paged(kv: PagedKV, q_lens: Tensor) -> None:
    """The paged ops' check: q_lens fit in kv_lens, the block table covers kv_lens. Host reads, as
    `check_store_slots`: a caller may run it once per step and pass `validate=False` to the per-layer ops."""
    if len(kv.kv_lens) != len(q_lens) or bool((q_lens > kv.kv_lens).any()):
        raise ValueError(f"q_lens {q_lens.tolist()} must fit in kv_lens {kv.kv_lens.tolist()}")
    need = (kv.kv_lens + kv.page_size - 1) // kv.page_size
    if bool((need > kv.block_table.shape[1]).any()):
        raise ValueError("block_table has fewer pages than kv_lens needs")


def mla_paged_prefill(
    q_nope: Tensor,
    q_pe: Tensor,
    latent_buffer: Tensor,
    kv_b_weight: Tensor,
    kv: PagedKV,
    *,
    cu_q: Tensor,
    scale: float,
    validate: bool = True,
    kv_rows: Tensor | None = None,
    causal: bool = True,
) -> Tensor:
    """New tokens' attention over cached prefix + new tokens. q_nope [T, H, Dn], q_pe [T, H, Dr], cu_q [N+1]
    -> o [T, H, Dv]. The new tokens' latent must already be stored (`mla_store`).
    `validate=False` skips `check_paged`; `kv_rows` is `sequence_slots(kv)` when the caller has it already
    (every MLA layer of a step shares it; the torch path needs it, the Triton one does not).
    `causal=False`: every new token attends to all kv_lens tokens of its sequence, the other new ones included
    (DSpark's block-non-causal draft pass)."""
    q_lens = cu_q[1:] - cu_q[:-1]
    if validate:
        check_paged(kv, q_lens)
    if kernel_backend(q_nope.device) == "triton":
        from kernels.mla_triton import mla_paged_triton

        return mla_paged_triton(q_nope, q_pe, latent_buffer, kv_b_weight, kv, q_lens, scale, causal=causal)
    cu_kv = torch.cat([kv.kv_lens.new_zeros(1), torch.cumsum(kv.kv_lens, 0)])
    return mla_attention(q_nope, q_pe, latent_buffer, kv_b_weight, cu_q=cu_q, cu_kv=cu_kv, scale=scale,
                         absorbed=False, kv_rows=sequence_slots(kv) if kv_rows is None else kv_rows, causal=causal)


def mla_paged_decode(
    q_nope: Tensor,
    q_pe: Tensor,
    latent_buffer: Tensor,
    kv_b_weight: Tensor,
    kv: PagedKV,
    *,
    scale: float,
    validate: bool = True,
    kv_rows: Tensor | None = None,
) -> Tensor:
    """One query token per sequence (the last of its kv_lens), absorbed form: [N, H, Dn|Dr] -> [N, H, Dv].
    `validate=False` skips `check_paged`; `kv_rows` as for `mla_paged_prefill`."""
    n = q_nope.shape[0]
    q_lens = torch.ones(n, dtype=torch.int64, device=q_nope.device)
    if validate:
        check_paged(kv, q_lens)
    if kernel_backend(q_nope.device) == "triton":
        from kernels.mla_triton import mla_paged_triton

        return mla_paged_triton(q_nope, q_pe, latent_buffer, kv_b_weight, kv, q_lens, scale)
    cu_q = torch.arange(n + 1, device=q_nope.device)
    cu_kv = torch.cat([kv.kv_lens.new_zeros(1), torch.cumsum(kv.kv_lens, 0)])
    return mla_attention(q_nope, q_pe, latent_buffer, kv_b_weight, cu_q=cu_q, cu_kv=cu_kv, scale=scale,
                         absorbed=True, kv_rows=sequence_slots(kv) if kv_rows is None else kv_rows)
