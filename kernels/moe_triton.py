"""Triton fused MoE: (token, choice) pairs sorted by expert and padded per expert to BLOCK_M rows, so each
row block has one expert; kernel 1 computes h = silu(x w1^T) * (x w3^T) for a block, kernel 2 the weighted
down projection per pair, and the k choices of a token are summed in torch (no atomics: deterministic).
fp32 inputs use IEEE dots (no TF32), so results match the torch path within fp32 rounding."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.moe import MoERoute, group_by_expert
from kernels.triton_launch import kernel

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


@kernel
def _gate_up_kernel(
    x, w1, w3, h, rows, block_expert, k_choices, D, N_INTER,
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
        wa = tl.load(w1 + e * N_INTER * D + offs_n[None, :] * D + offs_k[:, None], mask=wmask, other=0.0)
        wb = tl.load(w3 + e * N_INTER * D + offs_n[None, :] * D + offs_k[:, None], mask=wmask, other=0.0)
        if IEEE:
            acc1 += tl.dot(xa, wa, input_precision="ieee")
            acc3 += tl.dot(xa, wb, input_precision="ieee")
        else:
            acc1 += tl.dot(xa, wa)
            acc3 += tl.dot(xa, wb)
    hv = acc1 / (1.0 + tl.exp(-acc1)) * acc3
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
    every block."""
    groups = group_by_expert(route, num_experts)
    counts = groups.counts.tolist()
    rows: list[Tensor] = []
    experts: list[int] = []
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        blocks = triton.cdiv(c, BLOCK_M)
        run = torch.full((blocks * BLOCK_M,), -1, dtype=torch.int64, device=route.experts.device)
        run[:c] = groups.order[start : start + c]
        rows.append(run)
        experts.extend([e] * blocks)
        start += c
    dev = route.experts.device
    if not rows:
        return torch.empty(0, dtype=torch.int64, device=dev), torch.empty(0, dtype=torch.int64, device=dev)
    return torch.cat(rows), torch.tensor(experts, dtype=torch.int64, device=dev)


def fused_moe_triton(x: Tensor, route: MoERoute, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
    t, d = x.shape
    num_experts, inter, _ = w1.shape
    k = route.experts.shape[1]
    rows, block_expert = _padded_rows(route, num_experts)
    if len(block_expert) == 0:
        return torch.zeros_like(x)
    ieee = x.dtype == torch.float32
    xc, w1c, w3c, w2c = (a.contiguous() for a in (x, w1, w3, w2))
    h = torch.empty(t * k, inter, dtype=torch.float32, device=x.device)
    nb = len(block_expert)
    _gate_up_kernel[(nb, triton.cdiv(inter, BLOCK_N))](
        xc, w1c, w3c, h, rows, block_expert, k, d, inter, IEEE=ieee, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K
    )
    out = torch.empty(t * k, d, dtype=torch.float32, device=x.device)
    weights = route.weights.reshape(-1).float().contiguous()
    _down_kernel[(nb, triton.cdiv(d, BLOCK_N))](
        h, w2c, weights, out, rows, block_expert, d, inter, IEEE=ieee, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K
    )
    return out.view(t, k, d).sum(1).to(x.dtype)
