"""MLA attention (NoPE) over a latent cache: per token [c_kv (R) | k_pe (Dr)], k_pe shared by all heads.

Two mathematically equal forms: expanded (k, v materialised per head from kv_b_proj; the prefill form) and
absorbed (the query is moved into latent space, attention is MQA over the latent; the decode form).

Sequences run together, padded, in groups of similar lengths (`length_groups`): one gather of the latent rows
and a few batched GEMMs per group instead of a loop of small ops per sequence; padding is masked out.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import mla_decode_cpu as fused_mla

# A group may cost this much more than its sequences' own (query x key) work, plus a little slack, before a
# sequence starts a new group: bounds padding waste whatever the length mix.
_PAD_WASTE = 1.5
_PAD_SLACK = 4096


def _split_kv_b(kv_b_weight: Tensor, h: int, dn: int) -> tuple[Tensor, Tensor]:
    """kv_b_proj weight [H*(Dn+Dv), R] -> W_UK [H, Dn, R], W_UV [H, Dv, R] (per-head blocks: k rows, then v rows)."""
    w = kv_b_weight.view(h, -1, kv_b_weight.shape[-1])
    return w[:, :dn], w[:, dn:]


def length_groups(q_lens: list[int], kv_lens: list[int]) -> list[list[int]]:
    """Sequence ids in groups that pad well: longest kv first, a sequence joins the current group while the
    group's padded (count x max q x max kv) stays within _PAD_WASTE of its real work (+ slack)."""
    groups: list[list[int]] = []
    cur: list[int] = []
    work = qmax = kmax = 0
    for i in sorted((i for i in range(len(kv_lens)) if q_lens[i] > 0), key=lambda i: (-kv_lens[i], -q_lens[i])):
        nq, nk = max(qmax, q_lens[i]), max(kmax, kv_lens[i])
        nwork = work + q_lens[i] * kv_lens[i]
        if cur and (len(cur) + 1) * nq * nk > _PAD_WASTE * nwork + _PAD_SLACK:
            groups.append(cur)
            cur, work, nq, nk, nwork = [], 0, q_lens[i], kv_lens[i], q_lens[i] * kv_lens[i]
        cur.append(i)
        work, qmax, kmax = nwork, nq, nk
    if cur:
        groups.append(cur)
    return groups


def _absorbed_is_cheaper(q: int, k: int, h: int, dn: int, dv: int, r: int, dr: int) -> bool:
    """Multiply-adds of one sequence's attention, q queries over k cached tokens: the expanded form decompresses
    K and V (k h (dn + dv) r) and attends per head over dn + dr and dv channels; the absorbed form projects the
    queries and outputs (q h (dn + dv) r) and attends over the latent, r + dr and r channels."""
    expanded = k * h * (dn + dv) * r + q * k * h * (dn + dr + dv)
    absorbed = q * h * (dn + dv) * r + q * k * h * (2 * r + dr)
    return absorbed < expanded


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
    kv_rows: Tensor | None = None,
    causal: bool = True,
) -> Tensor:
    """q_nope [T, H, Dn], q_pe [T, H, Dr], latent [L, R+Dr] -> o [T, H, Dv].

    Sequence i's queries are the last (cu_q[i+1]-cu_q[i]) tokens of its cu_kv segment; causal in that alignment
    (`causal=False`: every query sees the whole segment, as DSpark's draft block sees itself).
    `absorbed=False` still computes groups of single queries (`length_groups`) in the absorbed form.
    `kv_rows` [cu_kv[-1]] (optional) names the latent row of each cached token, sequence after sequence (a
    paged buffer's slots); without it the segments are latent[cu_kv[i]:cu_kv[i+1]].
    """
    t, h, dn = q_nope.shape
    r = kv_b_weight.shape[-1]
    w_uk, w_uv = _split_kv_b(kv_b_weight, h, dn)
    dev = q_nope.device
    qb, kb = cu_q.tolist(), cu_kv.tolist()
    q_lens = [qb[i + 1] - qb[i] for i in range(len(qb) - 1)]
    kv_lens = [kb[i + 1] - kb[i] for i in range(len(kb) - 1)]
    # Queries in one form: absorbed, q_lat = W_UK^T q_nope, against [c | k_pe]; expanded, [q_nope | q_pe]
    # against per-head [k_nope | k_pe].
    q_main = torch.einsum("thd,hdr->thr", q_nope, w_uk) if absorbed else q_nope
    q_cat = torch.cat([q_main, q_pe], dim=-1)
    out = q_nope.new_empty(t, h, w_uv.shape[1])
    for group in length_groups(q_lens, kv_lens):
        idx = torch.tensor(group, device=dev)
        nq = torch.tensor([q_lens[i] for i in group], device=dev)
        nk = torch.tensor([kv_lens[i] for i in group], device=dev)
        q0, k0 = cu_q[idx], cu_kv[idx]
        qm, km = int(nq.max()), int(nk.max())
        j, s = torch.arange(qm, device=dev), torch.arange(km, device=dev)
        # Padded rows point at a real row of the same sequence (clamped) and are masked or dropped.
        q_rows = q0[:, None] + torch.minimum(j[None, :], nq[:, None] - 1)  # [G, Qm]
        k_pos = k0[:, None] + torch.minimum(s[None, :], nk[:, None] - 1)  # [G, Km]
        k_rows = k_pos if kv_rows is None else kv_rows[k_pos]
        lat = latent.index_select(0, k_rows.reshape(-1)).view(len(group), km, -1).to(q_nope.dtype)
        c = lat[..., :r]
        # Few queries over a long context (decode rows riding in a prefill step, a prompt's own tokens after a
        # cached prefix): the absorbed form when it multiplies less, as in a decode step; the expanded one
        # decompresses K and V over each whole context, whatever its queries.
        group_absorbed = absorbed or qm == 1 or _absorbed_is_cheaper(qm, km, h, dn, w_uv.shape[1], r, q_pe.shape[-1])
        if group_absorbed and not absorbed:
            qg = torch.cat([torch.einsum("gjhd,hdr->gjhr", q_nope[q_rows], w_uk), q_pe[q_rows]], dim=-1)
        else:
            qg = q_cat[q_rows]  # [G, Qm, H, E]
        if group_absorbed:
            scores = torch.einsum("gjhe,gse->ghjs", qg, lat)
        else:
            k_nope = torch.einsum("gsr,hdr->gshd", c, w_uk)
            k_pe = lat[..., None, r:].expand(-1, -1, h, -1)
            scores = torch.einsum("gjhe,gshe->ghjs", qg, torch.cat([k_nope, k_pe], dim=-1))
        # Query j of a sequence sits at kv position nk - nq + j and sees kv positions <= it (and < nk).
        pos = (nk - nq)[:, None] + j[None, :]  # [G, Qm]
        hidden = s[None, None, :] >= nk[:, None, None]  # [G, 1, Km]: padding
        if causal:
            hidden = hidden | (s[None, None, :] > pos[:, :, None])  # [G, Qm, Km]
        # In place on the fresh scores: the same values as out-of-place ops, without two more [G, H, Qm, Km]
        # tensors (a long prefill's largest) to allocate and write.
        probs = scores.float().mul_(scale).masked_fill_(hidden[:, None], float("-inf")).softmax(-1).to(q_nope.dtype)
        if group_absorbed:
            o = torch.einsum("ghjr,hvr->gjhv", torch.einsum("ghjs,gsr->ghjr", probs, c), w_uv)
        else:
            v = torch.einsum("gsr,hvr->gshv", c, w_uv)
            o = torch.einsum("ghjs,gshv->gjhv", probs, v)
        real = j[None, :] < nq[:, None]  # [G, Qm]
        out[q_rows[real]] = o[real]
    return out


def _absorbed_queries(q_nope: Tensor, q_pe: Tensor, kv_b_weight: Tensor) -> tuple[Tensor, Tensor]:
    """-> (the absorbed queries [N, H, R+Dr], W_UV [H, Dv, R])."""
    w_uk, w_uv = _split_kv_b(kv_b_weight, q_nope.shape[1], q_nope.shape[2])
    return torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_pe], dim=-1), w_uv


def mla_decode_padded_cpu(q_nope: Tensor, q_pe: Tensor, latent: Tensor, kv_b_weight: Tensor, kv_rows: Tensor,
                          kv_lens: Tensor, *, scale: float) -> Tensor:
    """`mla_decode_padded`'s C++ path for a captured step, whose caller checked once that it fits (fp32 on CPU,
    the op built) and holds kv_rows and kv_lens as int64: the same products, no per-call checks."""
    q, w_uv = _absorbed_queries(q_nope, q_pe, kv_b_weight)
    out = fused_mla.mla_decode_latent_cpu_prepared(q, latent, kv_rows.contiguous(), kv_lens.contiguous(),
                                                   w_uv.shape[-1], scale)
    return torch.einsum("nhr,hvr->nhv", out, w_uv)


def mla_decode_padded(
    q_nope: Tensor,
    q_pe: Tensor,
    latent: Tensor,
    kv_b_weight: Tensor,
    kv_rows: Tensor,
    kv_lens: Tensor,
    *,
    scale: float,
) -> Tensor:
    """One query per sequence over a padded row table, with no host read (a captured decode step).

    q_nope [N, H, Dn], q_pe [N, H, Dr], latent [L, R+Dr]; kv_rows [N, S] names sequence i's cached rows (its
    first kv_lens[i] entries; the rest are any valid row, masked out). The absorbed form, as `mla_attention`'s
    decode groups: the same products in the same order, padded to S instead of to each group's longest. In fp32 on
    CPU the middle (scores, softmax, weighted sum) is one C++ op instead (`mla_decode_cpu`: within rounding)."""
    q, w_uv = _absorbed_queries(q_nope, q_pe, kv_b_weight)
    r = w_uv.shape[-1]
    if fused_mla.available() and fused_mla.fusable(q, latent):  # no gathered copy, no padding
        return torch.einsum("nhr,hvr->nhv", fused_mla.mla_decode_latent_cpu(q, latent, kv_rows, kv_lens, r, scale),
                            w_uv)
    lat = latent[kv_rows].to(q_nope.dtype)  # [N, S, R+Dr]
    scores = torch.einsum("nhe,nse->nhs", q, lat)
    hidden = torch.arange(kv_rows.shape[1], device=kv_rows.device)[None, :] >= kv_lens[:, None]  # [N, S]
    probs = (scores.float() * scale).masked_fill(hidden[:, None], float("-inf")).softmax(-1).to(q_nope.dtype)
    return torch.einsum("nhr,hvr->nhv", torch.einsum("nhs,nsr->nhr", probs, lat[..., :r]), w_uv)
