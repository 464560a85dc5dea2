"""MoE: the routed experts, grouped by expert (plain torch), and the dispatch to the Triton fused path.

Experts are stacked: w13 [E, 2I, D] (rows [:I] gate = checkpoint w1, [I:] up = w3) and w2 [E, D, I] (down);
expert e is w2[e] act(gate, up) with a `glu.GLU` act (SwiGLU or K3's SiTU-GLU), and the output sums weight *
expert over the k choices of the route (`moe_route`). The Triton fused path (`moe_triton`, both activations)
runs on CUDA; the dispatch is `moe_experts`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kernels import moe_gemm_cpu as fused_gemm
from kernels.backend import kernel_backend
from kernels.glu import GLU, SILU
from kernels.moe_route import MoERoute, group_by_expert
from kernels.opaque_op import opaque_op

# (expert, rows [n, in]) -> rows [n, out]: one expert's GEMM (the dense weight's, or a weight-only quantised one's).
ExpertGemm = Callable[[int, Tensor], Tensor]


def moe_experts(x: Tensor, route: MoERoute, w13: Tensor, w2: Tensor, act: GLU = SILU) -> Tensor:
    """x [T, D], w13 [E, 2I, D] (gate rows, then up rows), w2 [E, D, I] -> sum_k weight_k * expert_k(x) [T, D].

    Torch: the (token, choice) pairs are gathered in expert order once, then one gate|up GEMM and one down GEMM
    per expert that has tokens, and one scatter-add; accumulation in fp32, the result in x's dtype."""
    if kernel_backend(x.device) == "triton":
        from kernels.moe_triton import fused_moe_triton

        return fused_moe_triton(x, route, w13, w2, act)
    if torch.compiler.is_compiling():  # a captured step: no host read of the routes
        return captured_experts(x, route, w13, w2, act)
    return moe_experts_by(x, route, w13.shape[0], w2.shape[-1], *_dense_gemms(w13, w2), act)


def _dense_gemms(w13: Tensor, w2: Tensor) -> tuple[ExpertGemm, ExpertGemm]:
    return (lambda e, xs: xs @ w13[e].t()), (lambda e, h: h @ w2[e].t())


def moe_experts_by(x: Tensor, route: MoERoute, num_experts: int, inter: int, gate_up: ExpertGemm,
                   down: ExpertGemm, act: GLU = SILU) -> Tensor:
    """The torch `moe_experts` with each expert's two GEMMs given as functions: `gate_up(e, x)` [n, 2I] (gate
    columns, then up), `down(e, h)` [n, D] (weight-only quantised experts run their kernels through this)."""
    if x.shape[0] == 1:
        return _one_token_experts(x, route, inter, gate_up, down, act)
    return _grouped_by(x, route, num_experts, inter, gate_up, down, act)


def _grouped_experts(x: Tensor, route: MoERoute, w13: Tensor, w2: Tensor, act: GLU) -> Tensor:
    """The grouped path for dense weights, whatever the token count."""
    return _grouped_by(x, route, w13.shape[0], w2.shape[-1], *_dense_gemms(w13, w2), act)


def _grouped_by(x: Tensor, route: MoERoute, num_experts: int, inter: int, gate_up: ExpertGemm,
                down: ExpertGemm, act: GLU) -> Tensor:
    t, d = x.shape
    k = route.experts.shape[1]
    groups = group_by_expert(route, num_experts)
    tok = groups.order // k
    xs = x[tok]  # [T*k, D], expert after expert
    ys = torch.empty(t * k, d, dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(groups.counts.tolist()):
        if count == 0:
            continue
        end = start + count
        gu = gate_up(e, xs[start:end])
        ys[start:end] = down(e, act(gu[:, :inter], gu[:, inter:]))
        start = end
    ys *= route.weights.reshape(-1)[groups.order, None].float()
    out = torch.zeros(t, d, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, ys)
    return out.to(x.dtype)


def _one_token_experts(x: Tensor, route: MoERoute, inter: int, gate_up: ExpertGemm, down: ExpertGemm,
                       act: GLU) -> Tensor:
    """`moe_experts` for one token (batch-1 decode): the grouped path's products and fp32 sum in expert order
    (so its bits), without sorting, gathering and scattering pairs."""
    experts, order = route.experts[0].sort(stable=True)
    weights = route.weights[0, order].float()
    out = torch.zeros(1, x.shape[1], dtype=torch.float32, device=x.device)
    for i, e in enumerate(experts.tolist()):
        gu = gate_up(e, x)
        out += down(e, act(gu[:, :inter], gu[:, inter:])).float() * weights[i]
    return out.to(x.dtype)


def captured_experts(x: Tensor, route: MoERoute, w13: Tensor, w2: Tensor, act: GLU = SILU) -> Tensor:
    """`moe_experts` for a compiled or graph-captured step: nothing the compiler traces reads the routes on the host.

    Few pairs (T*k < E, batch-1 decode): each token's k chosen experts only, in products and sums. Otherwise the
    grouped path itself, as one opaque op (`radixk3::routed_experts`): it reads the per-expert counts inside, where
    the compiler does not look, so each chosen (token, expert) pair runs once and each expert's weights are read
    once, with the eager step's bits; on CPU in fp32 the op runs the grouped expert GEMM op instead (`moe_gemm_cpu`:
    the same products within fp32 rounding, not the same bits)."""
    t, k = route.experts.shape
    num_experts, inter = w13.shape[0], w2.shape[-1]
    if t * k < num_experts:
        # Products and sums, not GEMMs on gathered weights: a compiler folds the gather into the reduction's
        # loads, so each chosen expert's weights are read once, never copied first.
        gu = (w13[route.experts] * x[:, None, None, :]).sum(-1)  # [T, k, 2I]
        h = act(gu[..., :inter], gu[..., inter:])
        y = (w2[route.experts] * h[:, :, None, :]).sum(-1)  # [T, k, D]
        return (y.float() * route.weights[..., None].float()).sum(1).to(x.dtype)
    return routed_experts(x, route.weights, route.experts, w13, w2, act.kind, act.beta, act.linear_beta)


@opaque_op("radixk3::routed_experts")
def routed_experts(x: Tensor, weights: Tensor, experts: Tensor, w13: Tensor, w2: Tensor, act_kind: str,
                   beta: float | None, linear_beta: float | None) -> Tensor:
    """The grouped path behind an op boundary, for captured steps: on CPU in fp32 the grouped expert GEMM op's
    while each expert has few rows (a decode step), else `_grouped_experts`."""
    route, act = MoERoute(weights, experts), GLU(act_kind, beta, linear_beta)
    if fused_gemm.available() and fused_gemm.fusable(x, w13, w2):
        out = fused_gemm.routed_experts_cpu(x, experts, weights, w13, w2, act)  # None: an expert has too many rows
        if out is not None:
            return out
    return _grouped_experts(x, route, w13, w2, act)


@torch.library.register_fake("radixk3::routed_experts")
def _(x: Tensor, weights: Tensor, experts: Tensor, w13: Tensor, w2: Tensor, act_kind: str, beta: float | None,
      linear_beta: float | None) -> Tensor:
    return torch.empty_like(x)
