"""Triton fused MoE: (token, choice) pairs sorted by expert and padded per expert to BLOCK_M rows, so each
row block has one expert; kernel 1 computes h = act(x w13[:I]^T, x w13[I:]^T) for a block, kernel 2 the
weighted down projection per pair, and the k choices of a token are summed in torch (no atomics:
deterministic). Both activations of `GLU` are fused: SwiGLU and K3's SiTU-GLU (tanh written with exp, as
1 - 2 / (exp(2z) + 1), which saturates correctly at both ends). fp32 inputs use IEEE dots (no TF32), so
results match the torch path within fp32 rounding."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.glu import GLU
from kernels.moe_route import MoERoute, group_by_expert
from kernels.triton_launch import kernel

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


@kernel
def _gate_up_kernel(
    x, w13, h, rows, block_expert, k_choices, D, N_INTER, beta, linear_beta,
    SITU: tl.constexpr, LINEAR_BETA: tl.constexpr,
    IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    pair = tl.load(rows + blk * BM + tl.arange(0, BM))
    mm = pair >= 0
    tok = tl.where(mm, pair // k_choices, 0).to(tl.int64)
    e = tl.load(block_expert + blk).to(tl.int64)
    mn = offs_n < N_INTER
    acc1 = tl.zeros([BM, BN], dtype=tl.float32)
    acc3 = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, D, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < D
        xa = tl.load(x + tok[:, None] * D + offs_k[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        wmask = mk[:, None] & mn[None, :]
        base = w13 + e * 2 * N_INTER * D + offs_k[:, None]
        wa = tl.load(base + offs_n[None, :] * D, mask=wmask, other=0.0)
        wb = tl.load(base + (N_INTER + offs_n[None, :]) * D, mask=wmask, other=0.0)
        if IEEE:
            acc1 += tl.dot(xa, wa, input_precision="ieee")
            acc3 += tl.dot(xa, wb, input_precision="ieee")
        else:
            acc1 += tl.dot(xa, wa)
            acc3 += tl.dot(xa, wb)
    sig = 1.0 / (1.0 + tl.exp(-acc1))
    if SITU:  # beta tanh(gate / beta) sigmoid(gate) * up', up' = linear_beta tanh(up / linear_beta) or up
        gate = beta * (1.0 - 2.0 / (tl.exp(2.0 * acc1 / beta) + 1.0)) * sig
        if LINEAR_BETA:
            acc3 = linear_beta * (1.0 - 2.0 / (tl.exp(2.0 * acc3 / linear_beta) + 1.0))
    else:
        gate = acc1 * sig
    hv = gate * acc3
    safe = tl.where(mm, pair, 0).to(tl.int64)
    tl.store(h + safe[:, None] * N_INTER + offs_n[None, :], hv, mask=mm[:, None] & mn[None, :])


@kernel
def _down_kernel(
    h, w2, weights, out, rows, block_expert, D, N_INTER,
    IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    pair = tl.load(rows + blk * BM + tl.arange(0, BM))
    mm = pair >= 0
    safe = tl.where(mm, pair, 0).to(tl.int64)
    e = tl.load(block_expert + blk).to(tl.int64)
    mn = offs_n < D
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, N_INTER, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < N_INTER
        ha = tl.load(h + safe[:, None] * N_INTER + offs_k[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        wa = tl.load(
            w2 + e * D * N_INTER + offs_n[None, :] * N_INTER + offs_k[:, None],
            mask=mk[:, None] & mn[None, :],
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(ha.to(wa.dtype), wa, input_precision="ieee")
        else:
            acc += tl.dot(ha.to(wa.dtype), wa)
    acc *= tl.load(weights + safe, mask=mm, other=0.0)[:, None]
    tl.store(out + safe[:, None] * D + offs_n[None, :], acc, mask=mm[:, None] & mn[None, :])


def _padded_rows(route: MoERoute, num_experts: int) -> tuple[Tensor, Tensor]:
    """Pair ids sorted by expert, each expert's run padded with -1 to a multiple of BLOCK_M; and the expert of
    every block. Vectorised: one host sync (the padded length), no loop over experts."""
    groups = group_by_expert(route, num_experts)
    counts = groups.counts
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    padded_end = torch.cumsum(blocks * BLOCK_M, 0)
    run_start = torch.cumsum(counts, 0) - counts
    expert_of = route.experts.reshape(-1)[groups.order]  # the expert of each sorted pair
    rank = torch.arange(groups.order.numel(), device=counts.device) - run_start[expert_of]
    dest = padded_end[expert_of] - blocks[expert_of] * BLOCK_M + rank
    total = int(padded_end[-1]) if num_experts else 0
    rows = torch.full((total,), -1, dtype=torch.int64, device=counts.device)
    rows[dest] = groups.order
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=counts.device), blocks)
    return rows, block_expert


def fused_moe_triton(x: Tensor, route: MoERoute, w13: Tensor, w2: Tensor, act: GLU) -> Tensor:
    t, d = x.shape
    num_experts, inter = w13.shape[0], w2.shape[-1]
    k = route.experts.shape[1]
    rows, block_expert = _padded_rows(route, num_experts)
    if len(block_expert) == 0:
        return torch.zeros_like(x)
    ieee = x.dtype == torch.float32
    xc, w13c, w2c = (a.contiguous() for a in (x, w13, w2))
    h = torch.empty(t * k, inter, dtype=torch.float32, device=x.device)
    nb = len(block_expert)
    _gate_up_kernel[(nb, triton.cdiv(inter, BLOCK_N))](
        xc, w13c, h, rows, block_expert, k, d, inter, act.gate_beta, act.linear_beta or 1.0,
        SITU=act.kind == "situ", LINEAR_BETA=act.linear_beta is not None,
        IEEE=ieee, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
    )
    out = torch.empty(t * k, d, dtype=torch.float32, device=x.device)
    weights = route.weights.reshape(-1).float().contiguous()
    _down_kernel[(nb, triton.cdiv(d, BLOCK_N))](
        h, w2c, weights, out, rows, block_expert, d, inter, IEEE=ieee, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K
    )
    return out.view(t, k, d).sum(1).to(x.dtype)
