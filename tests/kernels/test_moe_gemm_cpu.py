"""The grouped expert GEMM on CPU (`kernels.moe_gemm_cpu`) against the per-expert matmul in float64: within the
worst-case rounding of any fp32 summation order (|error| <= K * 2^-24 * sum |x w|, the classic gamma_K bound), over
shapes with and without a tail past the 16-float vectors, experts with no rows, one row and more rows than a block,
and through the MoE (`routed_experts_cpu`, the pairs summed into their tokens) against float64, beside the torch
grouped path."""

from __future__ import annotations

import platform

import pytest
import torch

from kernels import moe_gemm_cpu as fused
from kernels.glu import GLU, SILU
from kernels.moe import _grouped_experts
from kernels.moe_route import MoERoute

X86 = platform.machine().lower() in ("x86_64", "amd64")
pytestmark = pytest.mark.skipif(not X86, reason="the op is built on x86 only")


def test_builds_here() -> None:
    """On x86 with a compiler (CI included) the op must build: a silent fallback would leave it untested."""
    assert fused.available()


@pytest.mark.parametrize(("e", "n", "k"), [(16, 512, 512), (5, 37, 23), (3, 130, 80), (1, 4, 16)])
def test_grouped_gemm_is_each_experts_matmul(e: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(e * n + k)
    w = torch.randn(e, n, k, generator=gen)
    counts = torch.randint(0, 10, (e,), generator=gen)
    counts[0] = 0 if e > 1 else 1  # an expert with no rows
    if e > 2:
        counts[1], counts[2] = 1, 33  # one row; more rows than a block of four
    x = torch.randn(int(counts.sum()), k, generator=gen)
    y = fused.grouped_gemm(x, counts, w)
    expert = torch.repeat_interleave(torch.arange(e), counts)
    want = torch.einsum("pk,pnk->pn", x.double(), w[expert].double())
    bound = k * 2.0**-24 * torch.einsum("pk,pnk->pn", x.abs().double(), w[expert].abs().double())
    assert y.shape == (x.shape[0], n) and y.dtype == torch.float32
    assert bool(((y.double() - want).abs() <= bound).all())


def test_wrong_shapes_are_refused() -> None:
    w = torch.zeros(3, 8, 16)
    with pytest.raises(ValueError, match="grouped_gemm"):
        fused.grouped_gemm(torch.zeros(4, 16), torch.tensor([1, 1, 1]), w)


@pytest.mark.parametrize("t", [1, 7, 32])
@pytest.mark.parametrize("act", [SILU, GLU("situ", 1.0, None)])
def test_grouped_moe_matches_the_torch_path(t: int, act: GLU) -> None:
    """The MoE through the op against float64: its largest error no more than twice the torch path's own (two fp32
    GEMMs with the activation between them, each summing in its own order)."""
    gen = torch.Generator().manual_seed(t)
    e, d, inter, top = 16, 64, 32, 4
    w13, w2 = torch.randn(e, 2 * inter, d, generator=gen), torch.randn(e, d, inter, generator=gen)
    x = torch.randn(t, d, generator=gen)
    experts = torch.stack([torch.randperm(e, generator=gen)[:top] for _ in range(t)])
    route = MoERoute(torch.rand(t, top, generator=gen), experts)
    got = fused.routed_experts_cpu(x, experts, route.weights, w13, w2, act)
    assert got is not None
    torch_path = _grouped_experts(x, route, w13, w2, act)
    exact = torch.zeros(t, d, dtype=torch.float64)
    for i in range(t):
        for j in range(top):
            ex = int(experts[i, j])
            gu = w13[ex].double() @ x[i].double()
            exact[i] += route.weights[i, j].double() * (w2[ex].double() @ act(gu[:inter], gu[inter:]))
    assert float((got - exact).abs().max()) <= 2 * float((torch_path - exact).abs().max())


def test_many_rows_for_one_expert_take_the_torch_path() -> None:
    e, d, inter = 2, 16, 8
    x = torch.randn(fused.MAX_ROWS_PER_EXPERT + 1, d)
    route = MoERoute(torch.ones(x.shape[0], 1), torch.zeros(x.shape[0], 1, dtype=torch.int64))
    assert fused.routed_experts_cpu(x, route.experts, route.weights, torch.randn(e, 2 * inter, d),
                                    torch.randn(e, d, inter), SILU) is None
