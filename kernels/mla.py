"""MLA attention (NoPE) over a latent cache: per token [c_kv (R) | k_pe (Dr)], k_pe shared by all heads.

Two mathematically equal forms: expanded (k, v materialised per head from kv_b_proj; the prefill form) and
absorbed (the query is moved into latent space, attention is MQA over the latent; the decode form).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _split_kv_b(kv_b_weight: Tensor, h: int, dn: int) -> tuple[Tensor, Tensor]:
    """kv_b_proj weight [H*(Dn+Dv), R] -> W_UK [H, Dn, R], W_UV [H, Dv, R] (per-head blocks: k rows, then v rows)."""
    w = kv_b_weight.view(h, -1, kv_b_weight.shape[-1])
    return w[:, :dn], w[:, dn:]


def mla_attention(
    q_nope: Tensor,
    q_pe: Tensor,
    latent: Tensor,
    kv_b_weight: Tensor,
    *,
    cu_q: Tensor,
    cu_kv: Tensor,
    scale: float,
    absorbed: bool = False,
) -> Tensor:
    """q_nope [T, H, Dn], q_pe [T, H, Dr], latent [L, R+Dr] -> o [T, H, Dv].

    Sequence i's queries are the last (cu_q[i+1]-cu_q[i]) tokens of its cu_kv segment; causal in that alignment.
    """
    h, dn = q_nope.shape[1], q_nope.shape[2]
    r = kv_b_weight.shape[-1]
    w_uk, w_uv = _split_kv_b(kv_b_weight, h, dn)
    qb, kb = cu_q.tolist(), cu_kv.tolist()
    outs = []
    for i in range(len(qb) - 1):
        qn, qp = q_nope[qb[i] : qb[i + 1]], q_pe[qb[i] : qb[i + 1]]
        lat = latent[kb[i] : kb[i + 1]]
        c, k_pe = lat[:, :r], lat[:, r:]
        nq, nk = qn.shape[0], lat.shape[0]
        if absorbed:
            q_lat = torch.einsum("thd,hdr->thr", qn, w_uk)
            scores = torch.einsum("thr,sr->hts", q_lat, c) + torch.einsum("thd,sd->hts", qp, k_pe)
        else:
            k_nope = torch.einsum("sr,hdr->hsd", c, w_uk)
            scores = torch.einsum("thd,hsd->hts", qn, k_nope) + torch.einsum("thd,sd->hts", qp, k_pe)
        # Query j sits at kv position nk - nq + j and sees kv positions <= it.
        causal = torch.arange(nk, device=lat.device)[None, :] > (torch.arange(nq, device=lat.device) + nk - nq)[:, None]
        probs = (scores.float() * scale).masked_fill(causal, float("-inf")).softmax(-1).to(lat.dtype)
        if absorbed:
            o_lat = torch.einsum("hts,sr->thr", probs, c)
            outs.append(torch.einsum("thr,hvr->thv", o_lat, w_uv))
        else:
            v = torch.einsum("sr,hvr->hsv", c, w_uv)
            outs.append(torch.einsum("hts,hsv->thv", probs, v))
    return torch.cat(outs)
