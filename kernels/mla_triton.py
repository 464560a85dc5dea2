"""Triton MLA over paged latent KV, absorbed form: q_lat = W_UK^T q_nope per head (a torch matmul), then
one kernel does MQA with a (R+Dr)-dim key and an R-dim value over the latent rows the page table names,
with an online softmax; o = W_UV o_lat (a torch matmul). Serves prefill (many query tokens per sequence,
causal) and decode alike. No autotuning: fixed blocks, so it also runs under the interpreter."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.paged_kv import PagedKV
from kernels.triton_launch import kernel, outer_stride

BLOCK_N = 16


@kernel
def _mla_latent_attention_kernel(
    q_lat, q_pe, latent, out, block_table, tok_seq, tok_pos, scale, max_pages, row_stride,
    H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr,
    BH: tl.constexpr, BR: tl.constexpr, BDR: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_r = tl.arange(0, BR)
    offs_d = tl.arange(0, BDR)
    mh = offs_h < H
    mr = offs_r < R
    md = offs_d < DR
    seq = tl.load(tok_seq + t).to(tl.int64)
    last = tl.load(tok_pos + t)  # attends positions 0..last
    ql = tl.load(q_lat + (t * H + offs_h[:, None]) * R + offs_r[None, :], mask=mh[:, None] & mr[None, :], other=0.0)
    qp = tl.load(q_pe + (t * H + offs_h[:, None]) * DR + offs_d[None, :], mask=mh[:, None] & md[None, :], other=0.0)
    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BR], dtype=tl.float32)
    for start in range(0, last + 1, BN):
        pos = start + tl.arange(0, BN)
        valid = pos <= last
        page = tl.load(block_table + seq * max_pages + pos // PAGE, mask=valid, other=0).to(tl.int64)
        row = (page * PAGE + pos % PAGE) * row_stride
        c = tl.load(latent + row[:, None] + offs_r[None, :], mask=valid[:, None] & mr[None, :], other=0.0)
        kp = tl.load(latent + row[:, None] + R + offs_d[None, :], mask=valid[:, None] & md[None, :], other=0.0)
        c = c.to(tl.float32)
        s = tl.dot(ql, tl.trans(c), input_precision="ieee")
        s += tl.dot(qp, tl.trans(kp.to(tl.float32)), input_precision="ieee")
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(out + (t * H + offs_h[:, None]) * R + offs_r[None, :], o, mask=mh[:, None] & mr[None, :])


@kernel
def _store_kernel(buf, slots, src, row_stride, D: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BD + tl.arange(0, BD)
    m = offs < D
    slot = tl.load(slots + t).to(tl.int64)
    tl.store(buf + slot * row_stride + offs, tl.load(src + t * D + offs, mask=m), mask=m)


def _row_stride(latent_buffer: Tensor, width: int) -> int:
    """The row stride of a [num_slots, R + Dr] latent buffer (a pool-buffer view: rows strided, each contiguous)."""
    if latent_buffer.dim() != 2 or latent_buffer.shape[1] != width:
        raise ValueError(f"latent buffer shape {tuple(latent_buffer.shape)} != [num_slots, {width}]")
    return outer_stride(latent_buffer, "latent buffer")


def mla_store_triton(latent_buffer: Tensor, slots: Tensor, latent: Tensor) -> None:
    t, d = latent.shape
    stride = _row_stride(latent_buffer, d)
    if t == 0:
        return
    bd = min(1024, triton.next_power_of_2(d))
    src = latent.to(latent_buffer.dtype).contiguous()
    _store_kernel[(t, triton.cdiv(d, bd))](latent_buffer, slots.contiguous(), src, stride, D=d, BD=bd)


def mla_paged_triton(
    q_nope: Tensor,
    q_pe: Tensor,
    latent_buffer: Tensor,
    kv_b_weight: Tensor,
    kv: PagedKV,
    q_lens: Tensor,
    scale: float,
    causal: bool = True,
) -> Tensor:
    t, h, dn = q_nope.shape
    dr = q_pe.shape[-1]
    r = kv_b_weight.shape[-1]
    stride = _row_stride(latent_buffer, r + dr)
    w = kv_b_weight.float().view(h, -1, r)
    w_uk, w_uv = w[:, :dn], w[:, dn:]
    q_lat = torch.einsum("thd,hdr->thr", q_nope.float(), w_uk).contiguous()
    dev = q_nope.device
    q_lens = q_lens.to(dev, torch.int64)
    tok_seq = torch.repeat_interleave(torch.arange(len(q_lens), device=dev), q_lens, output_size=t)  # no sync
    first_q = torch.cumsum(q_lens, 0) - q_lens
    # query j of sequence i sits at kv position kv_len - q_len + j (non-causal: every query sees all kv_len)
    tok_pos = kv.kv_lens.to(dev)[tok_seq] - 1
    if causal:
        tok_pos = tok_pos - q_lens[tok_seq] + 1 + torch.arange(t, device=dev) - first_q[tok_seq]
    o_lat = torch.empty(t, h, r, dtype=torch.float32, device=dev)
    bh = max(16, min(64, triton.next_power_of_2(h)))
    if t:
        _mla_latent_attention_kernel[(t, triton.cdiv(h, bh))](
            q_lat, q_pe.float().contiguous(), latent_buffer, o_lat, kv.block_table.contiguous(), tok_seq, tok_pos,
            scale, kv.block_table.shape[1], stride, H=h, R=r, DR=dr, PAGE=kv.page_size, BH=bh,
            BR=max(16, triton.next_power_of_2(r)), BDR=max(16, triton.next_power_of_2(dr)), BN=BLOCK_N,
        )  # fmt: skip
    return torch.einsum("thr,hvr->thv", o_lat, w_uv).to(q_nope.dtype)
