"""Norms and feed-forward blocks of the Kimi family: RMSNorm, the dense SwiGLU MLP and the sigmoid-routed MoE.

Parameter names follow the public Kimi-Linear checkpoints so that `state_dict()` keys are the tensor names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixk3.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, cast back, then scale: the HF order, which matters for bf16 bit-equality.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA output norm: RMSNorm over the head dim, then times sigmoid(gate), all in fp32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (xf * torch.sigmoid(gate.float())).to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate x) * up x)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Expert(nn.Module):
    """One routed expert under the checkpoint's names: w1 = gate, w3 = up, w2 = down."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


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
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        choice = scores + self.e_score_correction_bias.float()  # the bias only steers selection
        if self.num_groups > 1:
            grouped = choice.view(x.shape[0], self.num_groups, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts)
        )
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts)
            if cfg.num_shared_experts > 0
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = torch.zeros_like(x)
        # Group tokens by expert: one matmul per hit expert instead of one per (token, expert).
        order = ids.flatten().argsort(stable=True)
        counts = torch.bincount(ids.flatten(), minlength=len(self.experts)).tolist()
        token_of = order // ids.shape[1]
        w_sorted = weights.flatten()[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start : start + n]
            y = self.experts[e](x[tok]) * w_sorted[start : start + n, None]
            out.index_add_(0, tok, y.to(x.dtype))
            start += n
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
