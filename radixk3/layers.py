"""Norms and feed-forward blocks of the Kimi family: RMSNorm, the GLU activation (SwiGLU or K3's SiTU-GLU), the
dense GLU MLP, and the fused parameter holders (the MoE is in `moe_layer`).

Projections that read the same input are fused into one GEMM (`FusedLinear`: gate|up, KDA's q|k|v) and the
routed experts are stacked (`moe_layer.Experts`: w13 [E, 2I, D], w2 [E, D, I]) for grouped GEMMs. The checkpoints keep
the separate per-projection / per-expert tensors: each fused module names them (`public_parts`), and
`tensor_names.public_layout` maps every public name to a view of the fused parameter, for loading, saving and
random init alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from kernels import moe
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
