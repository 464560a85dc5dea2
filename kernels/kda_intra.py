"""Intra-chunk terms of chunked KDA: pairwise decayed products, the UT transform, the scan's operands.

The decay between tokens j <= i of a chunk is exp(G_i - G_j) per key channel (G = in-chunk cumulative
log-decay). Split naively as exp(G_i) * exp(-G_j) in fp32 it overflows with per-channel decays and, worse,
loses the difference of two large exponents to rounding. sum_d x_i[d] k_j[d] exp(G_i - G_j) is formed, per
(chunk, head), by the cheapest exact way its decays allow:
- factored: (x_i exp(G_i - r)) . (k_j exp(r - G_j)), r = the midrange of G over the chunk, one matmul. The
  exponents come from a float64 cumulative sum, so their rounding (1e-16 relative) stays far below fp32's;
  the matmul runs in fp32 when every channel's range of G is <= RANGE_FP32 (factors within fp32's range),
  in float64 up to RANGE_FP64;
- blocked, beyond that: 16-token sub-blocks; an off-diagonal block splits at a point r between i and j, where
  both factors are <= 1 and exact in fp32 whatever the decay; each diagonal block goes through these same
  tiers as a chunk of its own, and a block that still decays too fast materialises its pairwise decays.
Exponents of the blocked path are sums of log-decays over the tokens between two points, summed directly
(a 0/1 matrix product), never differences of large cumulative sums.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

SUB = 16  # sub-block size of the blocked path and of the triangular inverse
RANGE_FP32 = 160.0  # factors exp(+-80) stay normal fp32 numbers
RANGE_FP64 = 1400.0  # factors exp(+-700) stay normal float64 numbers


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


def _factored(q: Tensor, k: Tensor, e: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """q, k [B, C, K], e = G - r float64 (|e| within `dtype`'s exp range): unmasked [B, C, C] fp32.
    The exponentials are taken in float64 and rounded once, so each factor carries one rounding."""
    up, down = e.exp().to(dtype), (-e).exp_().to(dtype)
    q, k = q.to(dtype), k.to(dtype)
    kc = (k * down).transpose(-1, -2)
    return ((q * up) @ kc).float(), ((k * up) @ kc).float()


def _materialised(q: Tensor, k: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """One block per row of the batch, q, k, g [B, c, K] (c <= SUB): the pairwise decays of j <= i, exact."""
    bsz, c, kdim = q.shape
    ii, jj = torch.tril_indices(c, c, device=q.device)
    qt, kt, gt = (x.transpose(0, 1).contiguous() for x in (q, k, g))  # [c, B, K]
    # Out of place (the same values): autograd keeps exp's and the first product's results for backward.
    ek = (_span_matrix(jj, ii, c) @ gt.view(c, -1)).view(-1, bsz, kdim).exp() * kt[jj]  # [pairs, B, K]
    out = torch.zeros(2, bsz, c * c, dtype=q.dtype, device=q.device)
    out[0][:, ii * c + jj] = (qt[ii] * ek).sum(-1).T
    out[1][:, ii * c + jj] = (ek * kt[ii]).sum(-1).T
    return out[0].view(bsz, c, c), out[1].view(bsz, c, c)


def _blocked(q: Tensor, k: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """q, k, g [B, C, K], C a multiple of SUB: diagonal sub-blocks through `_pairwise`, off-diagonal blocks
    split at a point between their rows and columns."""
    bsz, c, kdim = q.shape
    nb = c // SUB
    dq, dk = _pairwise(*(x.reshape(bsz * nb, SUB, kdim) for x in (q, k, g)))
    a = torch.zeros(2, bsz, nb, SUB, c, dtype=q.dtype, device=q.device)
    for b in range(nb):
        cols = slice(b * SUB, (b + 1) * SUB)
        a[0, :, b, :, cols] = dq.view(bsz, nb, SUB, SUB)[:, b]
        a[1, :, b, :, cols] = dk.view(bsz, nb, SUB, SUB)[:, b]
    for b in range(1, nb):
        # rows of block b against columns j < b*SUB, split at r = the end of block b-1:
        # exp(G_i - r) (the span r..i) times exp(r - G_j) (the span j..r), both <= 1
        r = b * SUB - 1
        rows_i = torch.arange(r + 1, r + 1 + SUB, device=q.device)
        cols_j = torch.arange(r + 1, device=q.device)
        rows = _span_sums(g, torch.full_like(rows_i, r), rows_i).movedim(0, -2).exp_()  # [B, SUB, K]
        cols = _span_sums(g, cols_j, torch.full_like(cols_j, r)).movedim(0, -2).exp_()  # [B, r+1, K]
        kc = (k[:, : r + 1] * cols).transpose(-1, -2)
        blk = slice(b * SUB, (b + 1) * SUB)
        a[0, :, b, :, : r + 1] = (q[:, blk] * rows) @ kc
        a[1, :, b, :, : r + 1] = (k[:, blk] * rows) @ kc
    return a[0].view(bsz, c, c), a[1].view(bsz, c, c)


def _pairwise(q: Tensor, k: Tensor, g: Tensor, cum: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q, k, g [B, C, K] -> unmasked (A_qk, A_kk) [B, C, C], each row of the batch by its cheapest exact tier.
    `cum`: g's float64 cumulative sum along C, if the caller has it."""
    cum = g.double().cumsum(-2) if cum is None else cum
    hi, lo = cum.amax(-2, keepdim=True), cum.amin(-2, keepdim=True)
    e = cum - (hi + lo) / 2
    rng = (hi - lo).amax(-1).squeeze(-1)  # [B]
    fallback = _blocked if q.shape[1] > SUB else _materialised
    tiers = (
        (rng <= RANGE_FP32, lambda *x: _factored(*x, torch.float32), (q, k, e)),
        ((rng > RANGE_FP32) & (rng <= RANGE_FP64), lambda *x: _factored(*x, torch.float64), (q, k, e)),
        (rng > RANGE_FP64, fallback, (q, k, g)),
    )
    for mask, fn, args in tiers:
        if bool(mask.all()):
            return fn(*args)
    a_qk = q.new_empty(*q.shape[:-1], q.shape[-2])
    a_kk = torch.empty_like(a_qk)
    for mask, fn, args in tiers:
        if bool(mask.any()):
            a_qk[mask], a_kk[mask] = fn(*(x[mask] for x in args))
    return a_qk, a_kk


def _unit_lower_inverse(a: Tensor) -> Tensor:
    """(I + a)^-1 for strictly lower-triangular a [B, C, C]: forward substitution inside 16-row diagonal
    blocks, then blocks merged pairwise, [[X1, 0], [A21, X2]] -> [[X1, 0], [-X2 A21 X1, X2]] (batched matmuls;
    a batched triangular solve loops over the batch and is much slower on small chunks)."""
    bsz, c, _ = a.shape
    if torch.is_grad_enabled() and a.requires_grad:
        # Training: the in-place blocked inverse below overwrites what autograd saved; a triangular solve
        # differentiates (rounding differs from the serving path's by ~1 ulp, inference is unchanged).
        eye = torch.eye(c, dtype=a.dtype, device=a.device).expand(bsz, c, c)
        return torch.linalg.solve_triangular(eye + a, eye, upper=False, unitriangular=True)
    s = min(SUB, c)
    nb = c // s
    diag = torch.stack([a[:, b * s : (b + 1) * s, b * s : (b + 1) * s] for b in range(nb)], 1)  # [B, nb, s, s]
    x = torch.eye(s, dtype=a.dtype, device=a.device).repeat(bsz, nb, 1, 1)
    for i in range(1, s):
        x[..., i, :i] = -(diag[..., i : i + 1, :i] @ x[..., :i, :i]).squeeze(-2)
    inv = a.new_zeros(bsz, c, c)
    for b in range(nb):
        inv[:, b * s : (b + 1) * s, b * s : (b + 1) * s] = x[:, b]
    size = s
    while size < c:
        for o in range(0, c, 2 * size):
            top, bot = slice(o, o + size), slice(o + size, o + 2 * size)
            inv[:, bot, top] = -(inv[:, bot, bot] @ a[:, bot, top]) @ inv[:, top, top]
        size *= 2
    return inv


def _solve(a_qk: Tensor, a_kk: Tensor, k: Tensor, v: Tensor, beta: Tensor, eg: Tensor) -> tuple[Tensor, ...]:
    """Mask the pairwise products, apply the UT transform: (A_qk, W, U)."""
    c, kdim = k.shape[-2:]
    lower = torch.ones(c, c, dtype=torch.bool, device=k.device).tril()
    a_qk = a_qk.masked_fill_(~lower, 0.0)
    # Masked before beta is applied (the same values): the unused upper triangle may overflow, and inf * 0 would
    # put NaN into beta's gradient.
    a_kk = a_kk.masked_fill_(~lower.tril(-1), 0.0) * beta[..., None]
    b = beta[..., None]
    if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad or beta.requires_grad or eg.requires_grad):
        rhs = torch.cat([b * eg * k, b * v], dim=-1)  # training: out= does not differentiate
    else:
        rhs = k.new_empty(*k.shape[:-1], kdim + v.shape[-1])  # [beta eg k | beta v], without torch.cat (slow)
        torch.mul(b * eg, k, out=rhs[..., :kdim])
        torch.mul(b, v, out=rhs[..., kdim:])
    x = (_unit_lower_inverse(a_kk.flatten(0, 1)) @ rhs.flatten(0, 1)).view_as(rhs)
    return a_qk, x[..., :kdim], x[..., kdim:]


def intra_terms(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> IntraTerms:
    """q (already scaled), k, g [G, H, C, K], v [G, H, C, V], beta [G, H, C]. Each (chunk, head) takes its form
    from its own decays alone, so its bits never depend on what else is in the group (other sequences, other
    heads, how wide the padding is)."""
    c = q.shape[-2]
    # float64 (differences of it lose nothing to cancellation), as a matmul (torch's cumsum is slow here)
    cum = torch.ones(c, c, dtype=torch.float64, device=g.device).tril() @ g.double()
    easy = ((cum.amax(2) - cum.amin(2)) <= RANGE_FP32).all(-1)  # [G, H]
    if bool(easy.all()):
        return _factored_terms(q, k, v, beta, cum)
    if not bool(easy.any()):
        return _general_terms(q, k, v, g, beta, cum)
    # Mixed: each kind of row on its own, as [rows, 1, C, .], then put back in place.
    rq, rk, rv, rg, rb, rc = (x.flatten(0, 1).unsqueeze(1) for x in (q, k, v, g, beta, cum))
    ez = easy.flatten()
    parts = [
        (ez, _factored_terms(rq[ez], rk[ez], rv[ez], rb[ez], rc[ez])),
        (~ez, _general_terms(rq[~ez], rk[~ez], rv[~ez], rg[~ez], rb[~ez], rc[~ez])),
    ]
    fields = []
    for i in range(len(IntraTerms._fields)):
        like = parts[0][1][i]
        out = like.new_empty(easy.numel(), *like.shape[1:])
        for mask, terms in parts:
            out[mask] = terms[i]
        fields.append(out.view(*easy.shape, *like.shape[2:]))
    return IntraTerms(*fields)


def _factored_terms(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, cum: Tensor) -> IntraTerms:
    """The common case, every (chunk, head) factored in fp32: every exponential comes from the two factors
    exp(+-(G - r)) and exp(r), each taken in float64 and rounded once."""
    hi, lo = cum.amax(2, keepdim=True), cum.amin(2, keepdim=True)
    mid = (hi + lo) / 2
    e = cum - mid
    up, down, er = e.exp().float(), (-e).exp_().float(), mid.exp().float()
    kc = (k * down).transpose(-1, -2)
    a_qk, w, u = _solve((q * up) @ kc, (k * up) @ kc, k, v, beta, up * er)
    last = up[:, :, -1:]
    return IntraTerms(q * up * er, a_qk, w, u, k * (last * down), (last * er).squeeze(2))


def _general_terms(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cum: Tensor) -> IntraTerms:
    """Decays too fast for fp32 factors somewhere: each (chunk, head) by `_pairwise`'s tiers."""
    c = q.shape[-2]
    flat = (x.flatten(0, 1) for x in (q, k, g, cum))
    a_qk, a_kk = (a.view(*q.shape[:-1], c) for a in _pairwise(*flat))
    eg = cum.exp().float()
    a_qk, w, u = _solve(a_qk, a_kk, k, v, beta, eg)
    last = cum[:, :, -1:]
    return IntraTerms(q * eg, a_qk, w, u, k * (last - cum).exp_().float(), last.squeeze(2).exp().float())
