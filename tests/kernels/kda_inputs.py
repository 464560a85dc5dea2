"""Seeded KDA test inputs shared by the kernel tests (imported by file name: pytest uses importlib mode)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from kernels.kda import kda_gate, l2norm
from oracles import fla_naive_kda


class KDAInputs(NamedTuple):
    q: Tensor  # [T, H, K], L2-normalised
    k: Tensor  # [T, H, K], L2-normalised
    v: Tensor  # [T, H, V]
    g: Tensor  # [T, H, K] log-decay
    beta: Tensor  # [T, H]
    cu_seqlens: Tensor  # [N+1] int64
    initial_state: Tensor  # [N, H, K, V] fp32


def model_like_gate_params(h: int, kdim: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """A_log = log U(1, 16) per head; dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 0.1] (fla's init)."""
    a_log = torch.log(1 + 15 * torch.rand(h, generator=gen))
    dt = torch.exp(math.log(1e-3) + (math.log(0.1) - math.log(1e-3)) * torch.rand(h * kdim, generator=gen))
    return a_log, dt + torch.log(-torch.expm1(-dt))


def kda_inputs(
    lens: list[int],
    h: int = 2,
    kdim: int = 16,
    vdim: int = 12,
    *,
    seed: int = 0,
    decay: str = "model",
    zero_state: bool = False,
) -> KDAInputs:
    """decay: "model" (gates as the model's init makes them), "fast" (channels that decay by hundreds per
    chunk, which the chunked form must handle exactly), "none" (g = 0)."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = l2norm(torch.randn(t, h, kdim, generator=gen))
    k = l2norm(torch.randn(t, h, kdim, generator=gen))
    v = torch.randn(t, h, vdim, generator=gen)
    raw = torch.randn(t, h, kdim, generator=gen)
    if decay == "model":
        a_log, dt_bias = model_like_gate_params(h, kdim, gen)
        g = kda_gate(raw, a_log, dt_bias)
    elif decay == "fast":
        g = kda_gate(3 * raw, torch.log(1 + 15 * torch.rand(h, generator=gen)), torch.randn(h * kdim, generator=gen))
    elif decay == "none":
        g = torch.zeros(t, h, kdim)
    else:
        raise ValueError(decay)
    beta = torch.rand(t, h, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)
    s0 = torch.zeros(len(lens), h, kdim, vdim) if zero_state else torch.randn(len(lens), h, kdim, vdim, generator=gen)
    return KDAInputs(q, k, v, g, beta, cu, s0)


def fla_reference(x: KDAInputs) -> tuple[Tensor, Tensor]:
    """fla-core's naive_recurrent_kda per sequence ([B=1, T, H, K] each): (o [T, H, V], states [N, H, K, V])."""
    naive = fla_naive_kda()
    outs, states = [], []
    b = x.cu_seqlens.tolist()
    for i in range(len(b) - 1):
        sl = slice(b[i], b[i + 1])
        o, s = naive.naive_recurrent_kda(
            *(t[sl][None] for t in (x.q, x.k, x.v, x.g, x.beta)),
            initial_state=x.initial_state[i : i + 1],
            output_final_state=True,
        )
        outs.append(o[0])
        states.append(s[0])
    return torch.cat(outs), torch.stack(states)
