"""Norms and feed-forward blocks of the Kimi family: RMSNorm, the dense GLU MLP and the sigmoid-routed MoE
(with K3's LatentMoE and SiTU-GLU activation as options).

Parameter names follow the checkpoints so that `state_dict()` keys are the tensor names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.moe import moe_route
from radixk3.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        # Normalise in fp32, cast back, then scale: the HF order, which matters for bf16 bit-equality.
        # `out_dtype` is the activation dtype when x is an fp32 mixture (Attention Residuals).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(out_dtype or x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA output norm: RMSNorm over the head dim, then times sigmoid(gate), all in fp32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (xf * torch.sigmoid(gate.float())).to(x.dtype)


@dataclass(frozen=True)
class GLU:
    """The gated activation act(gate) * up of every MLP: SwiGLU, or K3's SiTU-GLU
    gate' = beta tanh(gate / beta) sigmoid(gate), up' = beta_lin tanh(up / beta_lin) (up unchanged without
    beta_lin); a bounded SiLU that tends to SiLU as beta grows."""

    kind: str = "silu"
    beta: float | None = None
    linear_beta: float | None = None

    @classmethod
    def of(cls, cfg: ModelConfig) -> GLU:
        return cls(cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        beta = 1.0 if self.beta is None else self.beta
        gate = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
        if self.linear_beta is not None:
            up = self.linear_beta * torch.tanh(up / self.linear_beta)
        return gate * up


class MLP(nn.Module):
    """GLU MLP: down(act(gate x) * up x)."""

    def __init__(self, hidden: int, intermediate: int, act: GLU | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = act or GLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class Expert(nn.Module):
    """One routed expert under the checkpoint's names: w1 = gate, w3 = up, w2 = down."""

    def __init__(self, hidden: int, intermediate: int, act: GLU | None = None) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)
        self.act = act or GLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x), self.w3(x)))


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
        self.experts = nn.ModuleList(
            Expert(expert_dim, cfg.moe_intermediate_size, act) for _ in range(cfg.num_experts)
        )
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
            routed = self.routed(self.routed_expert_down_proj(x), weights, ids)
            if self.routed_expert_norm is not None:
                routed = self.routed_expert_norm(routed)
            out = self.routed_expert_up_proj(routed)
        else:
            out = self.routed(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_i w_i E_i(x) over each token's chosen experts."""
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
        return out
