"""Triton causal depthwise conv1d over pool-resident conv states: varlen prefill, state writes (final states,
checkpoints, replay), one-token decode. Same sum order as the torch code: w[:, 0] x_{t-W+1} first."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.state_checkpoints import StateCheckpoints
from kernels.triton_launch import kernel, outer_stride

BLOCK_T = 16
BLOCK_C = 64


@kernel
def _conv_prefill_kernel(
    x, w, y, pool, tok_seq, seq_start, seq_slot, seq_init, T, slot_stride, C: tl.constexpr, W: tl.constexpr,
    SILU: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """y[t] = sum_j w[:, j] x[t-W+1+j], where positions before the sequence start read its initial state."""
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mt = offs_t < T
    mc = offs_c < C
    seq = tl.load(tok_seq + offs_t, mask=mt, other=0)
    start = tl.load(seq_start + seq, mask=mt, other=0)
    slot = tl.load(seq_slot + seq, mask=mt, other=0).to(tl.int64)
    init = tl.load(seq_init + seq, mask=mt, other=0)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        pos = offs_t - (W - 1) + j
        inside = pos >= start
        m2 = mt[:, None] & mc[None, :]
        xv = tl.load(x + pos[:, None] * C + offs_c[None, :], mask=m2 & inside[:, None], other=0.0)
        col = (W - 1) - (start - pos)  # state column of a position before the start
        sv = tl.load(
            pool + (slot * slot_stride)[:, None] + offs_c[None, :] * (W - 1) + col[:, None],
            mask=m2 & (~inside & (init != 0))[:, None],
            other=0.0,
        )
        wj = tl.load(w + offs_c * W + j, mask=mc, other=0.0)
        acc += wj[None, :] * (xv.to(tl.float32) + sv.to(tl.float32))
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(y + offs_t[:, None] * C + offs_c[None, :], acc, mask=mt[:, None] & mc[None, :])


@kernel
def _conv_state_kernel(
    x, pool, src_start, src_end, src_slot, src_init, dst_slot, slot_stride, C: tl.constexpr, W: tl.constexpr,
    BC: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    """pool[dst[m]] = the W-1 inputs before x-row end[m] of the sequence starting at start[m], the source slot's
    state (or zeros) filling in before the start. One program reads everything it writes before writing."""
    m = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = offs_c < C
    start = tl.load(src_start + m).to(tl.int64)
    end = tl.load(src_end + m).to(tl.int64)
    slot = tl.load(src_slot + m).to(tl.int64)
    init = tl.load(src_init + m)
    dst = tl.load(dst_slot + m).to(tl.int64)
    offs_i = tl.arange(0, BW)  # the W-1 state columns, padded to a power of two
    mi = offs_i < W - 1
    pos = end - (W - 1) + offs_i
    inside = pos >= start
    m2 = mc[:, None] & mi[None, :]
    xv = tl.load(x + pos[None, :] * C + offs_c[:, None], mask=m2 & inside[None, :], other=0.0)
    col = (W - 1) - (start - pos)
    sv = tl.load(pool + slot * slot_stride + offs_c[:, None] * (W - 1) + col[None, :],
                 mask=m2 & (~inside & (init != 0))[None, :], other=0.0)  # fmt: skip
    tl.store(pool + dst * slot_stride + offs_c[:, None] * (W - 1) + offs_i[None, :], xv + sv, mask=m2)


@kernel
def _conv_decode_kernel(
    x, w, y, pool, slots, slot_stride, C: tl.constexpr, W: tl.constexpr, SILU: tl.constexpr, BC: tl.constexpr,
    BW: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = offs_c < C
    slot = tl.load(slots + n).to(tl.int64)
    base = pool + slot * slot_stride + offs_c * (W - 1)
    xt = tl.load(x + n * C + offs_c, mask=mc, other=0.0)
    acc = tl.zeros([BC], dtype=tl.float32)
    for j in tl.static_range(W - 1):
        acc += tl.load(w + offs_c * W + j, mask=mc, other=0.0) * tl.load(base + j, mask=mc, other=0.0).to(tl.float32)
    acc += tl.load(w + offs_c * W + (W - 1), mask=mc, other=0.0) * xt.to(tl.float32)
    # shift: read the whole window first, then write (one program owns these elements)
    offs_j = tl.arange(0, BW)
    mj = offs_j < W - 1
    nxt = tl.load(base[:, None] + offs_j[None, :] + 1, mask=mc[:, None] & (offs_j < W - 2)[None, :], other=0.0)
    window = tl.where((offs_j == W - 2)[None, :], xt[:, None].to(nxt.dtype), nxt)
    tl.store(base[:, None] + offs_j[None, :], window, mask=mc[:, None] & mj[None, :])
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(y + n * C + offs_c, acc, mask=mc)


def _silu(activation: str | None) -> bool:
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    return activation is not None


def _pool_stride(conv_pool: Tensor, c: int, width: int) -> int:
    """The slot stride of a [num_slots, C, W-1] conv pool (a pool-buffer view: slots strided, each contiguous)."""
    if tuple(conv_pool.shape[1:]) != (c, width - 1):
        raise ValueError(f"conv pool shape {tuple(conv_pool.shape)} != [num_slots, {c}, {width - 1}]")
    return outer_stride(conv_pool, "conv state pool")


def _write_states(
    x: Tensor, pool: Tensor, start: Tensor, end: Tensor, src: Tensor, init: Tensor, dst: Tensor, width: int
) -> None:
    if len(dst) == 0:
        return
    c = x.shape[-1]
    _conv_state_kernel[(len(dst), triton.cdiv(c, BLOCK_C))](
        x, pool, start, end, src, init, dst, _pool_stride(pool, c, width), C=c, W=width, BC=BLOCK_C,
        BW=triton.next_power_of_2(max(width - 1, 1)),
    )  # fmt: skip


def conv1d_prefill_triton(
    x: Tensor,
    weight: Tensor,
    conv_pool: Tensor,
    state_slots: Tensor,
    cu_seqlens: Tensor | None,
    has_initial_state: Tensor | None,
    checkpoints: StateCheckpoints | None,
    activation: str | None,
    commit: bool,
) -> Tensor:
    t, c = x.shape
    width = weight.shape[-1]
    stride = _pool_stride(conv_pool, c, width)
    dev = x.device
    cu = torch.tensor([0, t], device=dev) if cu_seqlens is None else cu_seqlens.to(dev)
    n = len(cu) - 1
    lens = cu[1:] - cu[:-1]
    tok_seq = torch.repeat_interleave(torch.arange(n, device=dev), lens, output_size=t)  # sizing it: no sync
    init = torch.ones(n, dtype=torch.int32, device=dev) if has_initial_state is None else has_initial_state.int()
    xc = x.contiguous()
    wf = weight.float().contiguous()
    y = torch.empty(t, c, dtype=torch.float32, device=dev)
    starts = cu[:-1].contiguous()
    _conv_prefill_kernel[(triton.cdiv(t, BLOCK_T), triton.cdiv(c, BLOCK_C))](
        xc, wf, y, conv_pool, tok_seq, starts, state_slots.contiguous(), init, t, stride, C=c, W=width,
        SILU=_silu(activation), BT=BLOCK_T, BC=BLOCK_C,
    )  # fmt: skip
    if checkpoints is not None and len(checkpoints.slot):
        seq = checkpoints.seq
        _write_states(
            xc, conv_pool, starts[seq], starts[seq] + checkpoints.offset, state_slots[seq], init[seq],
            checkpoints.slot.contiguous(), width,
        )  # fmt: skip
    if commit:
        _write_states(xc, conv_pool, starts, cu[1:].contiguous(), state_slots, init, state_slots, width)
    return y.to(x.dtype)


def conv1d_decode_triton(
    x: Tensor, weight: Tensor, conv_pool: Tensor, state_slots: Tensor, activation: str | None
) -> Tensor:
    n, c = x.shape
    width = weight.shape[-1]
    stride = _pool_stride(conv_pool, c, width)
    y = torch.empty(n, c, dtype=torch.float32, device=x.device)
    _conv_decode_kernel[(n, triton.cdiv(c, BLOCK_C))](
        x.contiguous(), weight.float().contiguous(), y, conv_pool, state_slots.contiguous(), stride, C=c, W=width,
        SILU=_silu(activation), BC=BLOCK_C, BW=triton.next_power_of_2(max(width - 1, 1)),
    )  # fmt: skip
    return y.to(x.dtype)


def conv1d_replay_triton(x: Tensor, conv_pool: Tensor, state_slots: Tensor, num_tokens: Tensor) -> None:
    """x [N, L, C] saved pre-conv inputs; each slot's state becomes the W-1 inputs before token num_tokens[i]."""
    n, length, c = x.shape
    width = conv_pool.shape[-1] + 1
    starts = torch.arange(n, device=x.device) * length
    ones = torch.ones(n, dtype=torch.int32, device=x.device)
    xc = x.to(conv_pool.dtype).contiguous().view(n * length, c)
    _write_states(xc, conv_pool, starts, starts + num_tokens, state_slots, ones, state_slots.contiguous(), width)
