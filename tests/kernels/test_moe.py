"""MoE routing against a per-token reading of the definition; grouped experts (stacked w13 / w2, SwiGLU and
K3's SiTU-GLU) on both backends against a token-by-token loop; routing and experts against transformers'
Kimi-Linear MoE gate and experts."""

from __future__ import annotations

import importlib
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kernels.glu import GLU, SILU
from kernels.moe import moe_experts
from kernels.moe_route import MoERoute, moe_route

E, D, INTER = 8, 24, 20


def route_by_definition(logits: torch.Tensor, bias: torch.Tensor, k: int, groups: int, topk_group: int,
                        scale: float) -> tuple[list[set[int]], torch.Tensor]:  # fmt: skip
    """One token at a time, with Python sorting: chosen sets and the weights by expert id [T, E]."""
    s = torch.sigmoid(logits)
    chosen: list[set[int]] = []
    dense = torch.zeros_like(s)
    per = E // groups
    for t in range(s.shape[0]):
        b = (s[t] + bias).tolist()
        gscore = [sum(sorted(b[g * per : (g + 1) * per], reverse=True)[:2]) for g in range(groups)]
        allowed = sorted(range(groups), key=lambda g: -gscore[g])[:topk_group]
        cand = [e for e in range(E) if e // per in allowed]
        pick = set(sorted(cand, key=lambda e: -b[e])[:k])
        total = sum(float(s[t, e]) for e in pick)
        for e in pick:
            dense[t, e] = s[t, e] / (total + 1e-20) * scale
        chosen.append(pick)
    return chosen, dense


@pytest.mark.parametrize("groups,topk_group", [(1, 1), (4, 2)])
def test_route_matches_definition(groups: int, topk_group: int) -> None:
    gen = torch.Generator().manual_seed(groups)
    logits, bias = torch.randn(30, E, generator=gen), torch.randn(E, generator=gen)
    r = moe_route(logits, top_k=3, correction_bias=bias, num_expert_group=groups, topk_group=topk_group,
                  routed_scaling_factor=2.446)  # fmt: skip
    chosen, dense = route_by_definition(logits, bias, 3, groups, topk_group, 2.446)
    assert [set(x) for x in r.experts.tolist()] == chosen
    got = torch.zeros(30, E).scatter_(1, r.experts, r.weights)
    torch.testing.assert_close(got, dense, rtol=0, atol=1e-6)


def kimi_linear_modeling() -> ModuleType:
    from oracles import transformers_module

    transformers_module()
    return importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")


def test_route_and_experts_match_transformers() -> None:
    """transformers' KimiLinearTopkRouter and KimiLinearExperts as external oracles."""
    mod = kimi_linear_modeling()
    cfg = SimpleNamespace(num_experts_per_tok=2, num_local_experts=E, hidden_size=D, routed_scaling_factor=2.446,
                          n_group=1, topk_group=1, norm_topk_prob=True, moe_intermediate_size=INTER,
                          hidden_act="silu", _experts_implementation="eager")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    router = mod.KimiLinearTopkRouter(cfg)
    experts = mod.KimiLinearExperts(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, D, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(E, generator=gen))
        w1, w3 = torch.randn(E, INTER, D, generator=gen) / 5, torch.randn(E, INTER, D, generator=gen) / 5
        w2 = torch.randn(E, D, INTER, generator=gen) / 5
        experts.gate_up_proj.copy_(torch.cat([w1, w3], dim=1))
        experts.down_proj.copy_(w2)
        x = torch.randn(9, D, generator=gen)
        _, w_tf, ids_tf = router(x)
        out_tf = experts(x, ids_tf, w_tf)
    r = moe_route(x @ router.weight.t(), top_k=2, correction_bias=router.e_score_correction_bias.detach(),
                  routed_scaling_factor=2.446)  # fmt: skip
    dense_tf = torch.zeros(9, E).scatter_(1, ids_tf, w_tf.float())
    torch.testing.assert_close(torch.zeros(9, E).scatter_(1, r.experts, r.weights), dense_tf, rtol=0, atol=1e-6)
    torch.testing.assert_close(moe_experts(x, r, torch.cat([w1, w3], dim=1), w2), out_tf, rtol=0, atol=1e-5)


def situ_by_formula(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """K3's SiTU-GLU written out: beta tanh(gate / beta) sigmoid(gate) * (linear_beta tanh(up / linear_beta))."""
    g = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    return g * (up if linear_beta is None else linear_beta * torch.tanh(up / linear_beta))


ACTS = {
    "silu": (SILU, lambda g, u: F.silu(g) * u),
    # betas below the pre-activations' spread (~1): both tanh saturate on part of the values
    "situ": (GLU("situ", 0.5, 1.0), lambda g, u: situ_by_formula(g, u, 0.5, 1.0)),
    "situ-default-beta": (GLU("situ"), lambda g, u: situ_by_formula(g, u, 1.0, None)),
}


@pytest.mark.parametrize("act_name", list(ACTS))
def test_experts_equal_token_loop(backend: str, act_name: str) -> None:
    act, formula = ACTS[act_name]
    gen = torch.Generator().manual_seed(3)
    t, k = 21, 3
    x = torch.randn(t, D, generator=gen)
    w1, w3 = torch.randn(E, INTER, D, generator=gen) / 5, torch.randn(E, INTER, D, generator=gen) / 5
    w2 = torch.randn(E, D, INTER, generator=gen) / 5
    logits = torch.randn(t, E, generator=gen)
    logits[:, 5] -= 100  # expert 5 gets no tokens
    r = moe_route(logits, top_k=k, routed_scaling_factor=1.5)
    out = moe_experts(x, r, torch.cat([w1, w3], dim=1), w2, act)
    ref = torch.zeros(t, D)
    for i in range(t):
        for j in range(k):
            e = int(r.experts[i, j])
            ref[i] += r.weights[i, j] * (w2[e] @ formula(w1[e] @ x[i], w3[e] @ x[i]))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 if backend == "torch" else 1e-4)


def test_bf16_experts_near_fp32() -> None:
    """bf16 weights and inputs, fp32 accumulation of the k choices: within bf16 rounding of the fp32 result."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(17, D, generator=gen)
    w13, w2 = torch.randn(E, 2 * INTER, D, generator=gen) / 5, torch.randn(E, D, INTER, generator=gen) / 5
    r = moe_route(torch.randn(17, E, generator=gen), top_k=2)
    act = GLU("situ", 2.0, None)
    ref = moe_experts(x, r, w13, w2, act)
    got = moe_experts(x.bfloat16(), r, w13.bfloat16(), w2.bfloat16(), act)
    assert got.dtype == torch.bfloat16
    # Inputs, weights, h and the output each rounded to 8 mantissa bits (2^-8 relative each), over O(1) values.
    assert (got.float() - ref).abs().max().item() < 4 * 2**-8 * ref.abs().max().item()


def test_unknown_activation_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported GLU activation 'gelu'"):
        GLU("gelu")


def test_no_tokens(backend: str) -> None:
    r = MoERoute(torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int64))
    out = moe_experts(torch.zeros(0, D), r, torch.zeros(E, 2 * INTER, D), torch.zeros(E, D, INTER))
    assert out.shape == (0, D)


@pytest.mark.parametrize("act", [SILU, GLU("situ", beta=3.0, linear_beta=5.0)])
def test_one_token_path_gives_the_grouped_bits(act: GLU) -> None:
    """Batch-1 decode takes a shortcut: the same bits as the grouped path for that token, and within rounding
    of the token's row in a batch (a GEMM of one row may round otherwise than a GEMM of several)."""
    from kernels.moe import _grouped_experts

    gen = torch.Generator().manual_seed(7)
    e, d, inter, t = 8, 16, 12, 5
    x = torch.randn(t, d, generator=gen)
    w13 = torch.randn(e, 2 * inter, d, generator=gen) / d**0.5
    w2 = torch.randn(e, d, inter, generator=gen) / inter**0.5
    route = moe_route(torch.randn(t, e, generator=gen), top_k=3, routed_scaling_factor=2.5)
    batched = moe_experts(x, route, w13, w2, act)
    for i in range(t):
        one = x[i : i + 1], MoERoute(route.weights[i : i + 1], route.experts[i : i + 1]), w13, w2, act
        assert torch.equal(moe_experts(*one), _grouped_experts(*one))
        torch.testing.assert_close(moe_experts(*one), batched[i : i + 1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("t", [1, 2, 21])  # T*k < E: the chosen experts' form; otherwise every expert, weighted
def test_captured_experts_equal_grouped(monkeypatch: pytest.MonkeyPatch, t: int) -> None:
    """The compiled step's MoE form (no host read of the routes) against the grouped path, run eagerly (the torch
    path behind the op boundary: the CPU grouped GEMM op has its own oracle in test_moe_gemm_cpu.py)."""
    from kernels import moe_gemm_cpu
    from kernels.moe import captured_experts

    monkeypatch.setenv(moe_gemm_cpu.ENV_VAR, "0")
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(t, D, generator=gen)
    w13, w2 = torch.randn(E, 2 * INTER, D, generator=gen) / 5, torch.randn(E, D, INTER, generator=gen) / 5
    route = moe_route(torch.randn(t, E, generator=gen), top_k=3, routed_scaling_factor=1.5)
    act = GLU("situ", 2.0, 3.0)
    got, want = captured_experts(x, route, w13, w2, act), moe_experts(x, route, w13, w2, act)
    if t * 3 < E:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    else:  # the grouped path itself, behind an op boundary
        assert torch.equal(got, want)


def test_compiled_moe_has_the_eager_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled step's MoE (batch 8, top-3 of E: every pair routed once, through `radixk3::routed_experts`)
    gives the eager step's bits, in one graph (its torch path: the CPU grouped GEMM op sums in its own order)."""
    from kernels import moe_gemm_cpu

    monkeypatch.setenv(moe_gemm_cpu.ENV_VAR, "0")
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(8, D, generator=gen)
    w13, w2 = torch.randn(E, 2 * INTER, D, generator=gen) / 5, torch.randn(E, D, INTER, generator=gen) / 5
    route = moe_route(torch.randn(8, E, generator=gen), top_k=3, routed_scaling_factor=1.5)
    act = GLU("situ", 2.0, 3.0)
    compiled = torch.compile(lambda *a: moe_experts(*a, act), fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x, route, w13, w2), moe_experts(x, route, w13, w2, act))
