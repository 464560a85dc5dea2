"""`GLU`: the gated activation of every MLP and expert (SwiGLU or K3's SiTU-GLU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


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
