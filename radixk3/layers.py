"""Norms and feed-forward blocks of the Kimi family: RMSNorm, the dense GLU MLP and the sigmoid-routed MoE
(with K3's LatentMoE and SiTU-GLU activation as options), and the fused parameter holders.

Projections that read the same input are fused into one GEMM (`FusedLinear`: gate|up, KDA's q|k|v) and the
routed experts are stacked (`Experts`: w13 [E, 2I, D], w2 [E, D, I]) for grouped GEMMs. The checkpoints keep
the separate per-projection / per-expert tensors: each fused module names them (`public_parts`), and
`tensor_names.public_layout` maps every public name to a view of the fused parameter, for loading, saving and
random init alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kernels import moe
from kernels.moe import MoERoute, moe_experts, moe_route
from radixk3.config import ModelConfig

# (parameter attribute, public tensor name relative to the module's parent, index of its part in the parameter)
PublicPart = tuple[str, str, tuple[int | slice, ...]]


def _row_parts(attr: str, parts: Sequence[tuple[str, int]]) -> Iterator[PublicPart]:
    start = 0
    for name, rows in parts:
        yield attr, f"{name}.weight", (slice(start, start + rows),)
        start += rows


class FusedLinear(nn.Linear):
    """Bias-free projections of one input in one GEMM. The weight stacks, in row order, the checkpoint's
    separate tensors `{name}.weight` (siblings of this module) of the given row counts."""

    def __init__(self, in_features: int, parts: Sequence[tuple[str, int]]) -> None:
        super().__init__(in_features, sum(rows for _, rows in parts), bias=False)
        self.parts = tuple(parts)
        self.sizes = [rows for _, rows in parts]

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self(x).split(self.sizes, dim=-1)

    def public_parts(self, local_name: str) -> Iterator[PublicPart]:
        return _row_parts("weight", self.parts)


class FusedWeight(nn.Module):
    """A weight [sum rows, *inner] stacking the checkpoint's tensors `{name}.weight` by rows (KDA's three short
    convs as one [3P, 1, W] depthwise weight, so the conv needs no per-call concatenation)."""

    def __init__(self, parts: Sequence[tuple[str, int]], inner: Sequence[int]) -> None:
        super().__init__()
        self.parts = tuple(parts)
        self.weight = nn.Parameter(torch.zeros(sum(rows for _, rows in parts), *inner))

    def public_parts(self, local_name: str) -> Iterator[PublicPart]:
        return _row_parts("weight", self.parts)


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


class GLU(moe.GLU):
    """`kernels.moe.GLU` (SwiGLU or K3's SiTU-GLU, the activation the expert kernels fuse), built from a config."""

    @classmethod
    def of(cls, cfg: ModelConfig) -> GLU:
        return cls(cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)


class MLP(nn.Module):
    """GLU MLP: down(act(gate x) * up x), gate and up in one GEMM (checkpoint: `gate_proj`, `up_proj`)."""

    def __init__(self, hidden: int, intermediate: int, act: moe.GLU | None = None) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear(hidden, [("gate_proj", intermediate), ("up_proj", intermediate)])
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = act or GLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(x)
        return self.down_proj(self.act(gate, up))


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
