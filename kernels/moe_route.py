"""The DeepSeek-V3 / Kimi "noaux_tc" MoE router, and the routed (token, choice) pairs grouped by expert.

Router: s = sigmoid(logits) in fp32; experts are chosen by s + e_score_correction_bias (the bias only
selects), optionally group-limited (groups scored by the sum of their top-2 biased scores, the best
`topk_group` kept); weights are the unbiased s of the chosen experts, renormalised w / (sum w + 1e-20), times
routed_scaling_factor. Shared by the expert ops (`moe`) and their Triton kernels (`moe_triton`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


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
