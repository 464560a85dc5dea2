"""Each native-K3 layer feature against its equation, computed independently here from the layer's weights
(read under their checkpoint names, as views of the fused parameters)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from radixk3.config import ModelConfig, preset
from radixk3.kda_attention import KDAAttention
from radixk3.layers import MLP
from radixk3.mla_attention import MLAAttention
from radixk3.model import build_model
from radixk3.moe_layer import MoE
from radixk3.tensor_names import public_tensors

TOL = 1e-5


def _cfg(**changes: object) -> ModelConfig:
    return preset("k3-tiny-native").replace(**changes)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _x(t: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(t, hidden, generator=torch.Generator().manual_seed(seed))


# --- KDA: safe gate and full-rank output gate -------------------------------------------------------------


def _conv_silu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv over time: y_t = sum_j w[:, j] x_{t - W + 1 + j}, then SiLU."""
    t, width = x.shape[0], w.shape[-1]
    padded = torch.cat([torch.zeros(width - 1, x.shape[1]), x])
    y = torch.stack([sum(w[:, j] * padded[i + j] for j in range(width)) for i in range(t)])
    return F.silu(y)


def _delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
                ) -> torch.Tensor:
    """Per head, S [K, V]: S = diag(exp g_t) S; S = S + beta_t k_t (v_t - S^T k_t)^T; o_t = S^T q_t."""
    t, h, d = q.shape
    out = torch.zeros(t, h, v.shape[-1], dtype=torch.float64)
    for head in range(h):
        s = torch.zeros(d, v.shape[-1], dtype=torch.float64)
        for i in range(t):
            kt, qt = k[i, head].double(), q[i, head].double()
            s = torch.exp(g[i, head].double())[:, None] * s
            s = s + beta[i, head].double() * torch.outer(kt, v[i, head].double() - s.T @ kt)
            out[i, head] = s.T @ qt
    return out.float()


def _kda_reference(layer: KDAAttention, x: torch.Tensor, lower_bound: float | None, full_rank: bool) -> torch.Tensor:
    h, d = layer.num_heads, layer.head_dim
    t = x.shape[0]
    w = public_tensors(layer)
    q = _conv_silu(x @ w["q_proj.weight"].T, w["q_conv1d.weight"][:, 0]).view(t, h, d)
    k = _conv_silu(x @ w["k_proj.weight"].T, w["k_conv1d.weight"][:, 0]).view(t, h, d)
    v = _conv_silu(x @ w["v_proj.weight"].T, w["v_conv1d.weight"][:, 0]).view(t, h, d)
    f = (x @ layer.f_a_proj.weight.T @ layer.f_b_proj.weight.T).view(t, h, d) + layer.dt_bias.view(h, d)
    a = layer.A_log.reshape(h, 1).exp()
    if lower_bound is None:
        g = -a * F.softplus(f)
    else:  # the safe gate: a log-decay bounded in (lb, 0)
        g = lower_bound * torch.sigmoid(a * f)
        assert (g >= lower_bound).all() and (g <= 0).all()  # the ends are reached only by rounding
    beta = torch.sigmoid(x @ layer.b_proj.weight.T)
    q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    o = _delta_rule(q * d**-0.5, k, v, g, beta)
    gate = x @ layer.g_proj.weight.T if full_rank else x @ layer.g_a_proj.weight.T @ layer.g_b_proj.weight.T
    eps = 1e-5 if full_rank else layer.eps  # K3's full-rank layer hard-codes the o_norm eps
    o = _rms(o, layer.o_norm.weight, eps) * torch.sigmoid(gate.view(t, h, d))
    return o.reshape(t, h * d) @ layer.o_proj.weight.T


@pytest.mark.parametrize(("full_rank", "lower_bound"), [(True, -5.0), (True, None), (False, -2.5)])
def test_kda_full_rank_and_safe_gate(full_rank: bool, lower_bound: float | None) -> None:
    cfg = _cfg(kda_full_rank_gate=full_rank, kda_gate_lower_bound=lower_bound, rms_norm_eps=1e-6)
    layer = build_model(cfg, seed=11).model.layers[0].self_attn
    assert isinstance(layer, KDAAttention) and hasattr(layer, "g_proj") == full_rank
    if full_rank:
        assert layer.g_proj.weight.shape == (cfg.kda_proj_dim, cfg.hidden_size)
    x = _x(40, cfg.hidden_size, 1)
    with torch.no_grad():
        got = layer(x, torch.tensor([0, 40]))
        expected = _kda_reference(layer, x, lower_bound, full_rank)
    assert (got - expected).abs().max().item() < TOL


def test_safe_gate_bounds_the_decay_where_softplus_does_not() -> None:
    """With lb = -0.5 no channel can decay by more than exp(-0.5) per token, whatever the gate input."""
    cfg = _cfg(kda_gate_lower_bound=-0.5)
    layer = build_model(cfg, seed=2).model.layers[0].self_attn
    x = 30 * _x(20, cfg.hidden_size, 3)  # large inputs drive the softplus gate far below -0.5
    with torch.no_grad():
        safe = layer(x, torch.tensor([0, 20]))
        layer.lower_bound = None
        unbounded = layer(x, torch.tensor([0, 20]))
    assert not torch.allclose(safe, unbounded)


# --- Gated MLA --------------------------------------------------------------------------------------------


def _mla_reference(layer: MLAAttention, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    t, h = x.shape[0], cfg.num_attention_heads
    dn, dr, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    c_q = _rms(x @ layer.q_a_proj.weight.T, layer.q_a_layernorm.weight, cfg.mla_q_norm_eps)
    q = (c_q @ layer.q_b_proj.weight.T).view(t, h, dn + dr)
    kv_a = x @ layer.kv_a_proj_with_mqa.weight.T
    c = _rms(kv_a[:, :r], layer.kv_a_layernorm.weight, cfg.mla_kv_norm_eps)
    k_pe = kv_a[:, r:]  # NoPE: used unrotated, shared by all heads
    kv = (c @ layer.kv_b_proj.weight.T).view(t, h, dn + dv)
    k = torch.cat([kv[..., :dn], k_pe[:, None].expand(t, h, dr)], dim=-1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(dn + dr)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", scores.softmax(-1), kv[..., dn:]).reshape(t, h * dv)
    return (o * torch.sigmoid(x @ layer.g_proj.weight.T)) @ layer.o_proj.weight.T


def test_gated_mla_with_q_lora() -> None:
    cfg = _cfg()
    layer = build_model(cfg, seed=5).model.layers[cfg.mla_layers[0]].self_attn
    assert isinstance(layer, MLAAttention) and layer.g_proj is not None and not hasattr(layer, "q_proj")
    assert layer.g_proj.weight.shape == (cfg.num_attention_heads * cfg.v_head_dim, cfg.hidden_size)
    x = _x(33, cfg.hidden_size, 4)
    with torch.no_grad():
        got = layer(x, torch.tensor([0, 33]))
        expected = _mla_reference(layer, x, cfg)
    assert (got - expected).abs().max().item() < TOL


# --- SiTU-GLU ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("beta", "linear_beta"), [(2.0, 4.0), (None, None), (0.5, None)])
def test_situ_glu(beta: float | None, linear_beta: float | None) -> None:
    cfg = _cfg(activation_situ_beta=beta, activation_situ_linear_beta=linear_beta)
    mlp = build_model(cfg, seed=6).model.layers[0].mlp  # layer 0 is dense
    assert isinstance(mlp, MLP)
    x = 3 * _x(25, cfg.hidden_size, 5)
    w = public_tensors(mlp)
    g, u = x @ w["gate_proj.weight"].T, x @ w["up_proj.weight"].T
    b = 1.0 if beta is None else beta
    gate = b * torch.tanh(g / b) * torch.sigmoid(g)
    up = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    with torch.no_grad():
        got = mlp(x)
    assert (got - (gate * up) @ mlp.down_proj.weight.T).abs().max().item() < TOL


def test_situ_tends_to_silu_for_large_beta() -> None:
    silu = build_model(_cfg(hidden_act="silu", activation_situ_beta=None, activation_situ_linear_beta=None),
                       seed=6).model.layers[0].mlp
    situ = build_model(_cfg(activation_situ_beta=1e4, activation_situ_linear_beta=1e4), seed=6).model.layers[0].mlp
    x = _x(10, 64, 7)
    with torch.no_grad():
        assert (silu(x) - situ(x)).abs().max().item() < 1e-4
        assert (build_model(_cfg(), seed=6).model.layers[0].mlp(x) - silu(x)).abs().max().item() > 1e-2


# --- LatentMoE --------------------------------------------------------------------------------------------


def _route(moe: MoE, x: torch.Tensor, cfg: ModelConfig) -> list[list[tuple[int, float]]]:
    """Per token: (expert, weight) pairs by sigmoid scores, bias-steered group-limited top-k, renormalised."""
    scores = torch.sigmoid(x @ moe.gate.weight.T)
    per_group = cfg.num_experts // cfg.num_expert_group
    out = []
    for s in scores:
        choice = s + moe.gate.e_score_correction_bias
        groups = sorted(range(cfg.num_expert_group),
                        key=lambda gi: -choice[gi * per_group:(gi + 1) * per_group].topk(2).values.sum().item())
        allowed = [e for gi in groups[: cfg.topk_group] for e in range(gi * per_group, (gi + 1) * per_group)]
        top = sorted(allowed, key=lambda e: -choice[e].item())[: cfg.num_experts_per_token]
        total = sum(s[e].item() for e in top)
        out.append([(e, s[e].item() / total * cfg.routed_scaling_factor) for e in top])
    return out


@pytest.mark.parametrize("use_norm", [True, False])
def test_latent_moe(use_norm: bool) -> None:
    cfg = _cfg(latent_moe_use_norm=use_norm)
    moe = build_model(cfg, seed=8).model.layers[1].block_sparse_moe
    assert isinstance(moe, MoE) and (moe.routed_expert_norm is not None) == use_norm
    w = public_tensors(moe)
    assert w["experts.0.w1.weight"].shape == (cfg.moe_intermediate_size, cfg.routed_expert_hidden_size)
    x = _x(30, cfg.hidden_size, 9)
    act = moe.experts.act
    with torch.no_grad():
        got = moe(x)
        u = x @ moe.routed_expert_down_proj.weight.T
        rows = []
        for i, pairs in enumerate(_route(moe, x, cfg)):
            r = torch.zeros(cfg.routed_expert_hidden_size)
            for e, weight in pairs:
                w1, w2, w3 = (w[f"experts.{e}.{n}.weight"] for n in ("w1", "w2", "w3"))
                r = r + weight * (act(u[i] @ w1.T, u[i] @ w3.T) @ w2.T)
            if use_norm:
                r = _rms(r, moe.routed_expert_norm.weight, cfg.rms_norm_eps)
            rows.append(r @ moe.routed_expert_up_proj.weight.T)
        shared = act(x @ w["shared_experts.gate_proj.weight"].T, x @ w["shared_experts.up_proj.weight"].T)
        shared = shared @ w["shared_experts.down_proj.weight"].T
        expected = torch.stack(rows) + shared
    assert (got - expected).abs().max().item() < TOL
