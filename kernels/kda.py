"""Kimi Delta Attention (KDA), plain-torch reference ops.

Conventions: packed varlen tokens with no batch dim; `cu_seqlens` int64 [N+1] (None: one sequence of all T
tokens). q, k [T, H, K] (already L2-normalised by the caller), v [T, H, V], g [T, H, K] log-decay (already
gated), beta [T, H] (already sigmoided). States use fla's layout [N, H, K, V] fp32 (key channel first).
All math is fp32; outputs are cast back to v's dtype.

Per token and head: S = diag(exp g_t) S;  S = S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (q_t * scale).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.kda_chunk import chunk_scan, plan_chunks


class KDAGate(NamedTuple):
    """`kda_gate`'s parameters, for the pool ops (decode, replay) that compute the decay from the raw gate."""

    A_log: Tensor  # H elements
    dt_bias: Tensor | None  # [H*K]
    lower_bound: float | None = None


def kda_gate(g_raw: Tensor, A_log: Tensor, dt_bias: Tensor | None, lower_bound: float | None = None) -> Tensor:
    """Per-channel log-decay [..., H, K] fp32 from the raw gate projection [..., H, K].

    No bound: -exp(A_log) * softplus(g_raw + dt_bias) (softplus threshold 20, torch's default).
    With `lower_bound` lb (K3's "safe gate"): lb * sigmoid(exp(A_log) * (g_raw + dt_bias)).
    """
    h, kdim = g_raw.shape[-2:]
    g = g_raw.float()
    if dt_bias is not None:
        g = g + dt_bias.float().view(h, kdim)
    a = A_log.float().reshape(h, 1).exp()
    if lower_bound is None:
        return -a * F.softplus(g)
    return lower_bound * torch.sigmoid(a * g)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim, in fp32 (eps inside the root, as fla), cast back."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def seq_bounds(cu_seqlens: Tensor | None, total: int) -> list[int]:
    if cu_seqlens is None:
        return [0, total]
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != total or any(b > a for a, b in zip(bounds[1:], bounds[:-1], strict=True)):
        raise ValueError(f"cu_seqlens {bounds} must rise from 0 to the token count {total}")
    return bounds


def _initial(initial_state: Tensor | None, n: int, h: int, kdim: int, vdim: int, device: torch.device) -> Tensor:
    if initial_state is None:
        return torch.zeros(n, h, kdim, vdim, dtype=torch.float32, device=device)
    if tuple(initial_state.shape) != (n, h, kdim, vdim):
        raise ValueError(f"initial_state shape {tuple(initial_state.shape)} != {(n, h, kdim, vdim)}")
    return initial_state.float().clone()


def kda_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The definition, token by token per sequence. Returns (o [T, H, V], final_state [N, H, K, V] fp32)."""
    t_total, h, kdim = q.shape
    vdim = v.shape[-1]
    scale = kdim**-0.5 if scale is None else scale
    bounds = seq_bounds(cu_seqlens, t_total)
    n = len(bounds) - 1
    states = _initial(initial_state, n, h, kdim, vdim, q.device)
    qf, kf, vf, gf, bf = (x.float() for x in (q, k, v, g, beta))
    o = torch.zeros(t_total, h, vdim, dtype=torch.float32, device=q.device)
    for i in range(n):
        s = states[i]
        for t in range(bounds[i], bounds[i + 1]):
            s = s * gf[t].exp()[..., None]
            ks = torch.einsum("hk,hkv->hv", kf[t], s)
            s = s + torch.einsum("hk,hv->hkv", bf[t][:, None] * kf[t], vf[t] - ks)
            o[t] = torch.einsum("hk,hkv->hv", qf[t] * scale, s)
        states[i] = s
    return o.to(v.dtype), states


def kda_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Same contract as `kda_recurrent`, computed in the chunked WY/UT form (chunks never cross sequences)."""
    t_total, h, kdim = q.shape
    vdim = v.shape[-1]
    scale = kdim**-0.5 if scale is None else scale
    bounds = seq_bounds(cu_seqlens, t_total)
    n = len(bounds) - 1
    states = _initial(initial_state, n, h, kdim, vdim, q.device)
    plan = plan_chunks(bounds, chunk_size, cuts=None, device=q.device)
    o, _ = chunk_scan(q, k, v, g, beta, states, plan, scale)
    return o.to(v.dtype), states


def kda_step(state: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """One recurrent step for a batch: state [N, H, K, V] fp32, k/g [N, H, K], v [N, H, V], beta [N, H].

    Elementwise products and sums only (no batched matmul), so the result of a row never depends on which
    other rows share the batch: decode and replay stay bit-identical whatever the batch.
    """
    return _delta_update_(state * g.float().exp()[..., None], k, v, beta)


def kda_step_(state: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """`kda_step` updating `state` (fp32, owned by the caller) in place and returning it: the same elementwise
    ops, so the same bits, without allocating a second [N, H, K, V] state."""
    return _delta_update_(state.mul_(g.float().exp()[..., None]), k, v, beta)


def _delta_update_(s: Tensor, k: Tensor, v: Tensor, beta: Tensor) -> Tensor:
    """s (already decayed) += beta k (v - s^T k)^T, in place."""
    kf = k.float()
    ks = (kf[..., None] * s).sum(-2)
    return s.addcmul_((beta.float()[..., None] * kf)[..., None], (v.float() - ks)[..., None, :])


def kda_read(state: Tensor, q: Tensor, scale: float) -> Tensor:
    """o = S^T (q * scale) for a batch: state [N, H, K, V], q [N, H, K] -> [N, H, V] fp32."""
    return ((q.float() * scale)[..., None] * state).sum(-2)


def kda_decode_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, *, scale: float | None = None
) -> Tensor:
    """One token per sequence (q, k, g [N, H, K], v [N, H, V], beta [N, H]); `state` [N, H, K, V] fp32 is
    updated in place. Returns o [N, H, V] in v's dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    new = kda_step(state.float(), k, v, g, beta)
    state.copy_(new)
    return kda_read(new, q, scale).to(v.dtype)
