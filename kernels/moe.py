"""MoE: the DeepSeek-V3 / Kimi "noaux_tc" router and the routed experts grouped by expert (plain torch).

Router: s = sigmoid(logits) in fp32; experts are chosen by s + e_score_correction_bias (the bias only
selects), optionally group-limited (groups scored by the sum of their top-2 biased scores, the best
`topk_group` kept); weights are the unbiased s of the chosen experts, renormalised w / (sum w + 1e-20), times
routed_scaling_factor. Experts are stacked: w13 [E, 2I, D] (rows [:I] gate = checkpoint w1, [I:] up = w3) and
w2 [E, D, I] (down); expert e is w2[e] act(gate, up) with `GLU` act (SwiGLU or K3's SiTU-GLU), and the output
sums weight * expert over the k choices. The Triton fused path (`moe_triton`, both activations) runs on CUDA;
the dispatch is `moe_experts`.
"""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class GLU:
    """The gated activation act(gate) * up of every MLP: SwiGLU, or K3's SiTU-GLU
    gate' = beta tanh(gate / beta) sigmoid(gate), up' = beta_lin tanh(up / beta_lin) (up unchanged without
    beta_lin); a bounded SiLU that tends to SiLU as beta grows. This is the torch reference of the activation
    that the Triton expert kernel fuses."""

    kind: str = "silu"  # "silu" or "situ"
    beta: float | None = None
    linear_beta: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("silu", "situ"):
            raise ValueError(f"unsupported GLU activation {self.kind!r}: expected 'silu' or 'situ'")

    @property
    def gate_beta(self) -> float:
        return 1.0 if self.beta is None else self.beta

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        beta = self.gate_beta
        gate = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
        if self.linear_beta is not None:
            up = self.linear_beta * torch.tanh(up / self.linear_beta)
        return gate * up


SILU = GLU()


def moe_experts(x: Tensor, route: MoERoute, w13: Tensor, w2: Tensor, act: GLU = SILU) -> Tensor:
    """x [T, D], w13 [E, 2I, D] (gate rows, then up rows), w2 [E, D, I] -> sum_k weight_k * expert_k(x) [T, D].

    Torch: the (token, choice) pairs are gathered in expert order once, then one gate|up GEMM and one down GEMM
    per expert that has tokens, and one scatter-add; accumulation in fp32, the result in x's dtype."""
    if kernel_backend(x.device) == "triton":
        from kernels.moe_triton import fused_moe_triton

        return fused_moe_triton(x, route, w13, w2, act)
    if x.shape[0] == 1:
        return _one_token_experts(x, route, w13, w2, act)
    return _grouped_experts(x, route, w13, w2, act)


def _grouped_experts(x: Tensor, route: MoERoute, w13: Tensor, w2: Tensor, act: GLU) -> Tensor:
    t, d = x.shape
    k = route.experts.shape[1]
    inter = w2.shape[-1]
    groups = group_by_expert(route, w13.shape[0])
    tok = groups.order // k
    xs = x[tok]  # [T*k, D], expert after expert
    ys = torch.empty(t * k, d, dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(groups.counts.tolist()):
        if count == 0:
            continue
        end = start + count
        gu = xs[start:end] @ w13[e].t()
        ys[start:end] = act(gu[:, :inter], gu[:, inter:]) @ w2[e].t()
        start = end
    ys *= route.weights.reshape(-1)[groups.order, None].float()
    out = torch.zeros(t, d, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, ys)
    return out.to(x.dtype)


def _one_token_experts(x: Tensor, route: MoERoute, w13: Tensor, w2: Tensor, act: GLU) -> Tensor:
    """`moe_experts` for one token (batch-1 decode): the grouped path's products and fp32 sum in expert order
    (so its bits), without sorting, gathering and scattering pairs."""
    inter = w2.shape[-1]
    experts, order = route.experts[0].sort(stable=True)
    weights = route.weights[0, order].float()
    out = torch.zeros(1, x.shape[1], dtype=torch.float32, device=x.device)
    for i, e in enumerate(experts.tolist()):
        gu = x @ w13[e].t()
        out += (act(gu[:, :inter], gu[:, inter:]) @ w2[e].t()).float() * weights[i]
    return out.to(x.dtype)
