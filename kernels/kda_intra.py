"""Intra-chunk terms of chunked KDA: pairwise decayed products, the UT transform, the scan's operands.

The decay between tokens j <= i of a chunk is exp(G_i - G_j) per key channel (G = in-chunk cumulative
log-decay). Two exact ways to form sum_d x_i[d] k_j[d] exp(G_i[d] - G_j[d]):
- factored: (x_i exp(G_i - r)) . (k_j exp(r - G_j)) with r = G at the chunk's midpoint, one matmul. Used for a
  (chunk, head) only when every |G_i - r| <= SAFE_EXP, so no factor overflows or underflows;
- exact: for chunks with fast-decaying channels, 16-token sub-blocks: off-diagonal blocks split at a point r
  between i and j (both factors <= 1), diagonal blocks materialise the pairwise decays.
Exponents are always sums of log-decays over the tokens between two points, summed directly (a 0/1 matrix
product): G_i - G_j as a difference of cumulative sums cancels catastrophically when a channel decays fast.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

SUB = 16  # sub-block size of the exact path
SAFE_EXP = 80.0  # exp(+-80) stays a normal fp32 with room for a K-term sum


class IntraTerms(NamedTuple):
    """Per chunk (all [NC, H, C, .] fp32): what the sequential scan needs."""

    qg: Tensor  # q * scale * exp(G)                       [NC, H, C, K]
    a_qk: Tensor  # sum_d q_i k_j exp(G_i - G_j), j <= i     [NC, H, C, C]
    w: Tensor  # T (exp(G) * k)                           [NC, H, C, K]
    u: Tensor  # T v                                      [NC, H, C, V]
    kd: Tensor  # k * exp(G_last - G)                      [NC, H, C, K]
    decay: Tensor  # exp(G_last)                              [NC, H, K]


def _span_matrix(lo: Tensor, hi: Tensor, n: int) -> Tensor:
    """[P, n]: row p is +1 on lo[p] < t <= hi[p] and -1 on hi[p] < t <= lo[p], so (row . g) = G_hi - G_lo
    summed over the tokens between, directly."""
    t = torch.arange(n, device=lo.device)
    up = (t > lo[:, None]) & (t <= hi[:, None])
    down = (t > hi[:, None]) & (t <= lo[:, None])
    return up.float() - down.float()


def _span_sums(g: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """G_hi[p] - G_lo[p] along dim -2, laid out pair-first: [..., T, K] -> [P, ..., K]."""
    flat = g.movedim(-2, 0).flatten(1)
    return (_span_matrix(lo, hi, g.shape[-2]) @ flat).view(-1, *g.shape[:-2], g.shape[-1])


def _pairwise_factored(q: Tensor, k: Tensor, e: Tensor) -> tuple[Tensor, Tensor]:
    """q, k, e [B, C, K] with e = G - r (|e| <= SAFE_EXP): unmasked [B, C, C] products."""
    up, down = e.exp(), (-e).exp()
    kc = (k * down).transpose(-1, -2)
    return (q * up) @ kc, (k * up) @ kc


def _pairwise_exact(q: Tensor, k: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """q, k, g [B, C, K]: [B, C, C] products, exact for any decay (see the module docstring)."""
    bsz, c, kdim = q.shape
    sub = min(SUB, c)
    nb = c // sub
    dev = q.device
    m = bsz * nb
    # Diagonal sub-blocks, pairs j <= i only, laid out [pair, block, K].
    ii, jj = torch.tril_indices(sub, sub, device=dev)
    qt, kt, gt = (x.reshape(m, sub, kdim).transpose(0, 1).contiguous() for x in (q, k, g))
    ek = (_span_matrix(jj, ii, sub) @ gt.view(sub, -1)).view(-1, m, kdim).exp_().mul_(kt[jj])
    a_diag = torch.zeros(2, m, sub * sub, dtype=q.dtype, device=dev)
    a_diag[0][:, ii * sub + jj] = (qt[ii] * ek).sum(-1).T
    a_diag[1][:, ii * sub + jj] = ek.mul_(kt[ii]).sum(-1).T
    a_diag = a_diag.view(2, bsz, nb, sub, sub)
    a = torch.zeros(2, bsz, nb, sub, c, dtype=q.dtype, device=dev)
    for b in range(nb):
        a[:, :, b, :, b * sub : (b + 1) * sub] = a_diag[:, :, b]
    for b in range(1, nb):
        # Row block b against columns j < b*sub, split at r = the end of block b-1:
        # exp(G_i - r) (the span r..i) times exp(r - G_j) (the span j..r), both <= 1.
        r = b * sub - 1
        rows_i = torch.arange(r + 1, r + 1 + sub, device=dev)
        cols_j = torch.arange(r + 1, device=dev)
        rows = _span_sums(g, torch.full_like(rows_i, r), rows_i).movedim(0, -2).exp_()  # [B, sub, K]
        cols = _span_sums(g, cols_j, torch.full_like(cols_j, r)).movedim(0, -2).exp_()  # [B, r+1, K]
        kc = (k[:, : r + 1] * cols).transpose(-1, -2)
        blk = slice(b * sub, (b + 1) * sub)
        a[0, :, b, :, : r + 1] = (q[:, blk] * rows) @ kc
        a[1, :, b, :, : r + 1] = (k[:, blk] * rows) @ kc
    return a[0].view(bsz, c, c), a[1].view(bsz, c, c)


def _pairwise(q: Tensor, k: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """[G, H, C, K] -> unmasked (A_qk, A_kk) [G, H, C, C], factored where safe and exact elsewhere."""
    g_, h, c, kdim = q.shape
    t = torch.arange(c, device=q.device)
    mid = torch.full_like(t, (c - 1) // 2)
    e = _span_sums(g, mid, t).movedim(0, -2)  # G_i - G_mid
    safe = e.abs().amax(dim=(-2, -1)) <= SAFE_EXP  # [G, H]
    if bool(safe.all()):
        return _pairwise_factored(q, k, e)
    a_qk = torch.empty(g_, h, c, c, dtype=q.dtype, device=q.device)
    a_kk = torch.empty_like(a_qk)
    for mask, fn, args in ((safe, _pairwise_factored, (q, k, e)), (~safe, _pairwise_exact, (q, k, g))):
        if bool(mask.any()):
            a_qk[mask], a_kk[mask] = fn(*(x[mask] for x in args))
    return a_qk, a_kk


def intra_terms(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> IntraTerms:
    """q (already scaled), k, g [G, H, C, K], v [G, H, C, V], beta [G, H, C]."""
    c, kdim = q.shape[-2:]
    a_qk, a_kk = _pairwise(q, k, g)
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    a_qk = a_qk.masked_fill_(~lower, 0.0)
    a_kk = (a_kk * beta[..., None]).masked_fill_(~lower.tril(-1), 0.0)
    eg = g.cumsum(2).exp_()  # exp(G_i): a running sum of like-signed terms, no cancellation
    rhs = torch.cat([beta[..., None] * eg * k, beta[..., None] * v], dim=-1)
    # (I + A_kk) X = rhs: unit lower-triangular, so the zero diagonal of a_kk is never read.
    x = torch.linalg.solve_triangular(a_kk, rhs, upper=False, unitriangular=True)
    t = torch.arange(c, device=q.device)
    to_last = _span_matrix(t, torch.full_like(t, c - 1), c) @ g  # G_last - G_i
    return IntraTerms(
        qg=q * eg,
        a_qk=a_qk,
        w=x[..., :kdim],
        u=x[..., kdim:],
        kd=k * to_last.exp_(),
        decay=g.sum(2).exp(),
    )
