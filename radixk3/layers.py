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

from kernels import glu
from radixk3.config import ModelConfig
from radixk3.parallel import shard_range
from radixk3.parallel_linear import ColumnParallelLinear, PublicPart, RowParallelLinear, TPRank, row_parts
from radixk3.tensor_names import Shard


class FusedLinear(ColumnParallelLinear):
    """Bias-free projections of one input in one GEMM. The weight stacks, in row order, the checkpoint's
    separate tensors `{name}.weight` (siblings of this module) of the given (full) row counts; under TP this
    rank's rows of each, split in whole `unit`s (heads)."""

    def __init__(self, in_features: int, parts: Sequence[tuple[str, int]], unit: int = 1) -> None:
        super().__init__(in_features, parts=parts, unit=unit)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self(x).split(self.sizes, dim=-1)


class FusedWeight(nn.Module, TPRank):
    """A weight [sum rows, *inner] stacking the checkpoint's tensors `{name}.weight` by rows (KDA's three short
    convs as one [3P, 1, W] depthwise weight, so the conv needs no per-call concatenation); under TP this rank's
    rows of each part, in whole `unit`s."""

    def __init__(self, parts: Sequence[tuple[str, int]], inner: Sequence[int], unit: int = 1) -> None:
        super().__init__()
        self._take_rank()
        self.parts = tuple(parts)
        self.inner = tuple(inner)
        self.row_slices = [shard_range(rows, self.tp_rank, self.tp_size, unit) for _, rows in parts]
        self.sizes = [s.stop - s.start for s in self.row_slices]
        self.weight = nn.Parameter(torch.zeros(sum(self.sizes), *inner))

    def public_parts(self, local_name: str) -> Iterator[PublicPart]:
        return row_parts("weight", [(name, rows) for (name, _), rows in zip(self.parts, self.sizes, strict=True)])

    def public_shards(self, local_name: str) -> Iterator[tuple[str, Shard]]:
        if self.tp_size == 1:
            return
        for (name, rows), index in zip(self.parts, self.row_slices, strict=True):
            yield f"{name}.weight", Shard((rows, *self.inner), (index,))


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


class GLU(glu.GLU):
    """`kernels.glu.GLU` (SwiGLU or K3's SiTU-GLU, the activation the expert kernels fuse), built from a config."""

    @classmethod
    def of(cls, cfg: ModelConfig) -> GLU:
        return cls(cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)


class MLP(nn.Module):
    """GLU MLP: down(act(gate x) * up x), gate and up in one GEMM (checkpoint: `gate_proj`, `up_proj`). Under TP
    the intermediate dim is split (gate|up column-parallel, down row-parallel); `reduce_results` False leaves the
    output a partial sum for the caller to all-reduce with others (an MoE's shared and routed experts)."""

    def __init__(self, hidden: int, intermediate: int, act: glu.GLU | None = None, *,
                 reduce_results: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = FusedLinear(hidden, [("gate_proj", intermediate), ("up_proj", intermediate)])
        self.down_proj = RowParallelLinear(intermediate, hidden, reduce_results=reduce_results)
        self.act = act or GLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(x)
        return self.down_proj(self.act(gate, up))
