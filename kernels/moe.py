"""MoE: the DeepSeek-V3 / Kimi "noaux_tc" router and the routed experts grouped by expert (plain torch).

Router: s = sigmoid(logits) in fp32; experts are chosen by s + e_score_correction_bias (the bias only
selects), optionally group-limited (groups scored by the sum of their top-2 biased scores, the best
`topk_group` kept); weights are the unbiased s of the chosen experts, renormalised w / (sum w + 1e-20), times
routed_scaling_factor. Expert e: w2[e] (silu(w1[e] x) * w3[e] x); the output sums weight * expert over the k
choices. The Triton fused path (`moe_triton`) runs on CUDA; the dispatch is `moe_experts`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.backend import kernel_backend


class MoERoute(NamedTuple):
    weights: Tensor  # [T, k] fp32
    experts: Tensor  # [T, k] int64


class ExpertGroups(NamedTuple):
    """The (token, choice) pairs sorted by expert: pair p = token p // k, choice p % k."""

    order: Tensor  # [T*k] int64 pair ids, expert after expert
    counts: Tensor  # [E] int64 pairs per expert


def moe_route(
    router_logits: Tensor,
    *,
    top_k: int,
    correction_bias: Tensor | None = None,
    num_expert_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> MoERoute:
    """router_logits [T, E] -> the top_k experts per token and their weights."""
    t, e = router_logits.shape
    scores = torch.sigmoid(router_logits.float())
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group > 1:
        if e % num_expert_group:
            raise ValueError(f"{e} experts do not split into {num_expert_group} groups")
        grouped = choice.view(t, num_expert_group, e // num_expert_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(t, e)
    experts = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return MoERoute(weights * routed_scaling_factor, experts)


def group_by_expert(route: MoERoute, num_experts: int) -> ExpertGroups:
    flat = route.experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return ExpertGroups(order, torch.bincount(flat, minlength=num_experts))


def moe_experts(x: Tensor, route: MoERoute, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
    """x [T, D], w1/w3 [E, I, D] (gate/up), w2 [E, D, I] (down) -> sum_k weight_k * expert_k(x) [T, D]."""
    if kernel_backend(x.device) == "triton":
        from kernels.moe_triton import fused_moe_triton

        return fused_moe_triton(x, route, w1, w3, w2)
    t, d = x.shape
    k = route.experts.shape[1]
    groups = group_by_expert(route, w1.shape[0])
    out = torch.zeros(t, d, dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(groups.counts.tolist()):
        if count == 0:
            continue
        pairs = groups.order[start : start + count]
        start += count
        tok = pairs // k
        xe = x[tok]
        h = F.silu(xe @ w1[e].t()) * (xe @ w3[e].t())
        y = (h @ w2[e].t()).float() * route.weights.reshape(-1)[pairs, None]
        out.index_add_(0, tok, y)
    return out.to(x.dtype)
