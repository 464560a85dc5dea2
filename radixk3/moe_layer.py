"""The sigmoid-routed MoE of the Kimi family: the router, the stacked routed experts (grouped GEMMs) and the
MoE block (shared experts, K3's LatentMoE), with its tensor and expert parallelism.

Parallel layout (`parallel_state()` when the block is built): with tp_size N and ep_size M, the N TP ranks form
M expert-parallel blocks of g = N / M ranks. EP rank p holds the routed experts [p E/M, (p+1) E/M), each with its
intermediate dim split over the g ranks of the block (w13's gate rows and up rows split alike, w2's columns);
`--ep 1` is plain TP (every rank holds every expert, I/N of each). The shared experts split their intermediate
dim over all N ranks; the router and LatentMoE's down/up projections are replicated. Every rank sees every
token (the attention output is replicated), so each rank's output is a partial sum and one all-reduce combines
them. LatentMoE's `routed_expert_norm` is nonlinear: the routed partial sums are all-reduced before it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels import glu
from kernels.moe import moe_experts
from kernels.moe_route import MoERoute, moe_route
from radixk3.config import ConfigError, ModelConfig
from radixk3.layers import GLU, MLP, PublicPart, RMSNorm
from radixk3.packed_experts import PackedWeights
from radixk3.parallel import ParallelState, parallel_state, shard_range, tp_all_reduce
from radixk3.parallel_linear import Linear, TPRank
from radixk3.quant_format import ExpertQuant
from radixk3.tensor_names import Shard


class MoEShard(NamedTuple):
    """Which routed experts, and which part of each, one rank holds (global indices)."""

    experts: range  # the routed experts held here
    inter: slice  # the part of each held expert's intermediate dim


def moe_shard(cfg: ModelConfig, state: ParallelState) -> MoEShard:
    n, m = state.tp_size, state.ep_size
    g = n // m  # TP ranks per EP rank: they split each expert's intermediate dim
    if cfg.num_experts % m:
        raise ConfigError(f"--ep {m} must divide num_experts {cfg.num_experts}")
    if cfg.moe_intermediate_size % g:
        raise ConfigError(f"--tp {n} / --ep {m} = {g} must divide moe_intermediate_size {cfg.moe_intermediate_size}")
    experts = shard_range(cfg.num_experts, state.ep_rank, m)
    return MoEShard(range(experts.start, experts.stop), shard_range(cfg.moe_intermediate_size, state.tp_rank % g, g))


def _whole(part: slice, size: int) -> bool:
    return part.start == 0 and part.stop == size


class ExpertPairs(NamedTuple):
    """The (token, choice) pairs routed to this rank's experts, one choice per row."""

    tokens: torch.Tensor  # [P] token of each pair
    route: MoERoute  # weights [P, 1], local expert ids [P, 1]


def dispatch_local(route: MoERoute, held: range) -> ExpertPairs:
    """Dispatch: the pairs whose expert is in `held`. Every rank holds every token here (gloo has no
    all_to_all), so dispatch is a selection and the combine is the block's all-reduce; an all-to-all dispatch
    (sending each pair's row to its expert's rank) would replace this one function and `combine_local`."""
    k = route.experts.shape[1]
    flat = route.experts.reshape(-1)
    pairs = ((flat >= held.start) & (flat < held.stop)).nonzero().squeeze(1)
    local = MoERoute(route.weights.reshape(-1)[pairs, None], flat[pairs, None] - held.start)
    return ExpertPairs(torch.div(pairs, k, rounding_mode="floor"), local)


def combine_local(y: torch.Tensor, pairs: ExpertPairs, num_tokens: int) -> torch.Tensor:
    """Each pair's weighted expert output [P, D] summed into its token (fp32): this rank's partial output."""
    out = torch.zeros(num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
    return out.index_add_(0, pairs.tokens, y.float()).to(y.dtype)


class Experts(nn.Module):
    """The routed experts held here, stacked for grouped GEMMs: w13_weight [E_held, 2I_part, D] (rows [:I_part]
    the gate, checkpoint `experts.{e}.w1`; rows [I_part:] the up projection, `experts.{e}.w3`) and w2_weight
    [E_held, D, I_part] (`experts.{e}.w2`). Unsharded: every expert, whole.

    With `quant` (a packed checkpoint) they are held packed instead, one `PackedWeights` per projection (w1, w3,
    w2), and each step dequantises the experts it routes to (in expert order, so the grouped GEMMs are those of
    the dense experts holding the dequantised values)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: glu.GLU,
                 held: range | None = None, inter: slice | None = None, quant: ExpertQuant | None = None) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.full_intermediate = num_experts, hidden, intermediate
        self.held = range(num_experts) if held is None else held
        self.inter = slice(0, intermediate) if inter is None else inter
        self.intermediate = self.inter.stop - self.inter.start
        self.quant = quant
        self.act = act
        # Set by `weight_quant.quantize_model_` (weight-only int8 / int4 of the dense experts): runs them instead.
        self.quantized: nn.Module | None = None
        if quant is None:
            self.w13_weight = nn.Parameter(torch.zeros(len(self.held), 2 * self.intermediate, hidden))
            self.w2_weight = nn.Parameter(torch.zeros(len(self.held), hidden, self.intermediate))
            return
        self.w1 = PackedWeights(quant, num_experts, self.held, intermediate, hidden, rows=self.inter)
        self.w3 = PackedWeights(quant, num_experts, self.held, intermediate, hidden, rows=self.inter)
        self.w2 = PackedWeights(quant, num_experts, self.held, hidden, intermediate, cols=self.inter)

    @property
    def holds_all(self) -> bool:
        return len(self.held) == self.num_experts

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_i w_i E_i(x) over each token's chosen experts held here, over this rank's intermediate part
        (`kernels.moe.moe_experts`); a partial sum when the experts are sharded."""
        route = MoERoute(weights, ids)
        if self.holds_all:
            return self._experts(x, route)
        pairs = dispatch_local(route, self.held)
        y = self._experts(x[pairs.tokens], pairs.route)
        return combine_local(y, pairs, x.shape[0])

    def _experts(self, x: torch.Tensor, route: MoERoute) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized(x, route, self.act)
        if self.quant is None:
            return moe_experts(x, route, self.w13_weight, self.w2_weight, self.act)
        active = route.experts.unique()  # sorted: the routed experts keep their order, so their GEMM order
        w13 = torch.cat([self.w1.dequant(active, x.dtype), self.w3.dequant(active, x.dtype)], dim=1)
        w2 = self.w2.dequant(active, x.dtype)
        return moe_experts(x, MoERoute(route.weights, torch.searchsorted(active, route.experts)), w13, w2, self.act)

    def public_parts(self, local_name: str) -> Iterator[PublicPart]:
        if self.quant is not None:
            return  # the packed projections declare their own
        i = self.intermediate
        for j, e in enumerate(self.held):
            yield "w13_weight", f"{local_name}.{e}.w1.weight", (j, slice(0, i))
            yield "w2_weight", f"{local_name}.{e}.w2.weight", (j,)
            yield "w13_weight", f"{local_name}.{e}.w3.weight", (j, slice(i, 2 * i))

    def public_shards(self, local_name: str) -> Iterator[tuple[str, Shard]]:
        if self.quant is not None or self.holds_all and _whole(self.inter, self.full_intermediate):
            return
        d, i = self.hidden, self.full_intermediate
        for e in range(self.num_experts):
            here = e in self.held
            yield f"{local_name}.{e}.w1.weight", Shard((i, d), (self.inter,) if here else None)
            yield f"{local_name}.{e}.w2.weight", Shard((d, i), (slice(None), self.inter) if here else None)
            yield f"{local_name}.{e}.w3.weight", Shard((i, d), (self.inter,) if here else None)


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


class MoE(nn.Module, TPRank):
    """Routed experts plus shared experts. LatentMoE (K3, `routed_expert_hidden_size`): the routed experts run
    in a latent dimension, u = down(x), r = sum_i w_i E_i(u) (routing scale included), optionally r = RMSNorm(r),
    out = up(r) + shared(x); the router and the shared experts see the full hidden state. Sharded as the module
    docstring says; `forward` returns the whole (all-reduced) output on every rank."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self._take_rank()  # a block built replicated (`parallel.replicated`) runs no collective
        act = GLU.of(cfg)
        latent = cfg.routed_expert_hidden_size
        expert_dim = cfg.hidden_size if latent is None else latent
        self.shard = moe_shard(cfg, parallel_state())
        self.gate = Router(cfg)
        self.experts = Experts(cfg.num_experts, expert_dim, cfg.moe_intermediate_size, act,
                               self.shard.experts, self.shard.inter, cfg.expert_quant)
        # Column/row-parallel over the intermediate dim, left unreduced: its partial output joins the routed one
        # in the block's single all-reduce.
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts, act, reduce_results=False)
            if cfg.num_shared_experts > 0
            else None
        )
        self.routed_expert_down_proj: Linear | None = None
        self.routed_expert_up_proj: Linear | None = None
        self.routed_expert_norm: RMSNorm | None = None
        if latent is not None:
            self.routed_expert_down_proj = Linear(cfg.hidden_size, latent)
            self.routed_expert_up_proj = Linear(latent, cfg.hidden_size)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(latent, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if self.routed_expert_down_proj is not None and self.routed_expert_up_proj is not None:
            routed = self.experts(self.routed_expert_down_proj(x), weights, ids)
            if self.routed_expert_norm is not None:
                # The norm needs the whole routed sum: reduce it (with the shared part, one collective) first.
                routed, shared = self._all_reduce_pair(routed, shared)
                out = self.routed_expert_up_proj(self.routed_expert_norm(routed))
                return out if shared is None else out + shared
            out = self.routed_expert_up_proj(routed)  # linear: up(sum of parts) = sum of up(part)
        else:
            out = self.experts(x, weights, ids)
        if shared is not None:
            out = out + shared
        return self._all_reduce(out)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return tp_all_reduce(x) if self.tp_size > 1 else x

    def _all_reduce_pair(self, a: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sum `a` and `b` ([T, *], same dtype) over the TP group in one all-reduce."""
        if self.tp_size == 1 or b is None:
            return self._all_reduce(a), b
        both = tp_all_reduce(torch.cat([a, b], dim=-1))
        return both[:, : a.shape[1]], both[:, a.shape[1]:]
