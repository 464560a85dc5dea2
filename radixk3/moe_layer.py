"""The sigmoid-routed MoE of the Kimi family: the router, the stacked routed experts (grouped GEMMs) and the
MoE block (shared experts, K3's LatentMoE). Tensor and expert parallelism of the MoE live here too."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kernels import moe
from kernels.moe import MoERoute, moe_experts, moe_route
from radixk3.config import ModelConfig
from radixk3.layers import GLU, MLP, PublicPart, RMSNorm


class Experts(nn.Module):
    """The routed experts stacked for grouped GEMMs: w13_weight [E, 2I, D] (rows [:I] the gate, checkpoint
    `experts.{e}.w1`; rows [I:] the up projection, `experts.{e}.w3`) and w2_weight [E, D, I] (`experts.{e}.w2`)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: moe.GLU) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.w13_weight = nn.Parameter(torch.zeros(num_experts, 2 * intermediate, hidden))
        self.w2_weight = nn.Parameter(torch.zeros(num_experts, hidden, intermediate))
        self.act = act

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_i w_i E_i(x) over each token's chosen experts (`kernels.moe.moe_experts`)."""
        return moe_experts(x, MoERoute(weights, ids), self.w13_weight, self.w2_weight, self.act)

    def public_parts(self, local_name: str) -> Iterator[PublicPart]:
        i = self.intermediate
        for e in range(self.w13_weight.shape[0]):
            yield "w13_weight", f"{local_name}.{e}.w1.weight", (e, slice(0, i))
            yield "w2_weight", f"{local_name}.{e}.w2.weight", (e,)
            yield "w13_weight", f"{local_name}.{e}.w3.weight", (e, slice(i, 2 * i))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))
        self.top_k = cfg.num_experts_per_token
        self.num_groups = cfg.num_expert_group
        self.topk_group = cfg.topk_group
        self.renormalize = cfg.moe_renormalize
        self.scaling = cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3 noaux_tc routing: (weights [T, k] fp32, expert ids [T, k])."""
        route = moe_route(
            F.linear(x.float(), self.weight.float()), top_k=self.top_k,
            correction_bias=self.e_score_correction_bias, num_expert_group=self.num_groups,
            topk_group=self.topk_group, renormalize=self.renormalize, routed_scaling_factor=self.scaling,
        )
        return route.weights, route.experts


class MoE(nn.Module):
    """Routed experts plus shared experts. LatentMoE (K3, `routed_expert_hidden_size`): the routed experts run
    in a latent dimension, u = down(x), r = sum_i w_i E_i(u) (routing scale included), optionally r = RMSNorm(r),
    out = up(r) + shared(x); the router and the shared experts see the full hidden state."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        act = GLU.of(cfg)
        latent = cfg.routed_expert_hidden_size
        expert_dim = cfg.hidden_size if latent is None else latent
        self.gate = Router(cfg)
        self.experts = Experts(cfg.num_experts, expert_dim, cfg.moe_intermediate_size, act)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts, act)
            if cfg.num_shared_experts > 0
            else None
        )
        self.routed_expert_down_proj: nn.Linear | None = None
        self.routed_expert_up_proj: nn.Linear | None = None
        self.routed_expert_norm: RMSNorm | None = None
        if latent is not None:
            self.routed_expert_down_proj = nn.Linear(cfg.hidden_size, latent, bias=False)
            self.routed_expert_up_proj = nn.Linear(latent, cfg.hidden_size, bias=False)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(latent, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.routed_expert_down_proj is not None and self.routed_expert_up_proj is not None:
            routed = self.experts(self.routed_expert_down_proj(x), weights, ids)
            if self.routed_expert_norm is not None:
                routed = self.routed_expert_norm(routed)
            out = self.routed_expert_up_proj(routed)
        else:
            out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
