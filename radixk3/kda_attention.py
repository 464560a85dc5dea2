"""Kimi Delta Attention layer: projections, short conv, gated delta rule, gated norm.

Kimi-Linear: low-rank output gate g_b(g_a(x)), decay g = -exp(A_log) softplus(f + dt_bias). Native K3 switches:
`kda_full_rank_gate` (one full-rank output gate `g_proj` [H*D, hidden], and K3's o_norm eps 1e-5) and
`kda_gate_lower_bound` lb (the safe gate g = lb * sigmoid(exp(A_log) (f + dt_bias)), bounded in (lb, 0)).

State per sequence lives in the cache's slots, reached through the batch's attention backend: the recurrent
state [H, K, V] (fp32) and the conv state (the last W-1 pre-conv q|k|v inputs). Fresh sequences (prefix 0)
start from zeros whatever their slot holds.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from kernels.conv1d import causal_conv1d
from kernels.kda import kda_chunked, kda_gate, l2norm
from radixk3.config import ModelConfig
from radixk3.forward_batch import ForwardBatch
from radixk3.layers import FusedLinear, FusedWeight, gated_rms_norm
from radixk3.parallel import parallel_state, shard_range
from radixk3.parallel_linear import ColumnParallelLinear, Linear, RowParallelLinear, linears
from radixk3.tensor_names import Shard


class KDAAttention(nn.Module):
    """Under TP the heads are split: q|k|v and their short convs by channel, A_log / dt_bias, beta (`b_proj`) and
    the gate's full-rank projections (`f_b`, `g_b` or `g_proj`) by head; the low-rank `*_a` projections and the
    per-head-dim o_norm are replicated; o_proj is row-parallel (its all-reduce makes the output whole)."""

    def __init__(self, cfg: ModelConfig, kda_index: int) -> None:
        super().__init__()
        hid, h, d, w = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size
        p = h * d
        state = parallel_state()
        self.heads = shard_range(h, state.tp_rank, state.tp_size)  # this rank's heads
        self.full_heads = h
        self.kda_index = kda_index  # which of the cache's KDA state tensors is ours
        self.num_heads, self.head_dim = h // state.tp_size, d
        local_p = self.num_heads * d
        self.eps = cfg.kda_o_norm_eps
        self.lower_bound = cfg.kda_gate_lower_bound
        # q|k|v in one GEMM and their short convs as one [3P, 1, W] weight; the checkpoint keeps
        # `{q,k,v}_proj.weight` and `{q,k,v}_conv1d.weight` (see `tensor_names.public_layout`).
        self.qkv_proj = FusedLinear(hid, [("q_proj", p), ("k_proj", p), ("v_proj", p)], unit=d)
        self.qkv_conv1d = FusedWeight([("q_conv1d", p), ("k_conv1d", p), ("v_conv1d", p)], (1, w), unit=d)
        # Kimi-Linear checkpoints hold A_log as [1, 1, H, 1], K3 ones as [H].
        h_local = self.num_heads
        self.A_log = nn.Parameter(torch.zeros(h_local) if cfg.is_k3_format else torch.zeros(1, 1, h_local, 1))
        self.dt_bias = nn.Parameter(torch.zeros(local_p))
        self.f_a_proj = Linear(hid, d)
        self.f_b_proj = ColumnParallelLinear(d, p, unit=d)
        self.b_proj = ColumnParallelLinear(hid, h)
        if cfg.kda_full_rank_gate:
            self.g_proj = ColumnParallelLinear(hid, p, unit=d)
        else:
            self.g_a_proj = Linear(hid, d)
            self.g_b_proj = ColumnParallelLinear(d, p, unit=d)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(d))
        self.o_proj = RowParallelLinear(p, hid, unit=d)

    def public_shards(self, local_name: str) -> Iterator[tuple[str, Shard]]:
        """A_log and dt_bias by head (the projections declare their own shards)."""
        if self.num_heads == self.full_heads:
            return
        heads, d = self.heads, self.head_dim
        if self.A_log.dim() == 1:
            yield f"{local_name}.A_log", Shard((self.full_heads,), (heads,))
        else:
            yield f"{local_name}.A_log", Shard((1, 1, self.full_heads, 1), (slice(None), slice(None), heads))
        yield f"{local_name}.dt_bias", Shard((self.full_heads * d,), (slice(heads.start * d, heads.stop * d),))

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections of x: q|k|v [T, 3P], the decay gate's low rank [T, D], beta's logits [T, H] and the
        pre-sigmoid output gate [T, H*D] (one few-row GEMM call for the four that read x, where that serves)."""
        full_rank_gate = hasattr(self, "g_proj")
        gate_in = self.g_proj if full_rank_gate else self.g_a_proj
        qkv, f_a, b, g = linears(x, (self.qkv_proj, self.f_a_proj, self.b_proj, gate_in))
        return qkv, f_a, b, g if full_rank_gate else self.g_b_proj(g)

    def conv_weight(self) -> torch.Tensor:
        """The depthwise weight [3P, W] of the pre-conv q|k|v (a view: no per-call copy)."""
        return self.qkv_conv1d.weight.squeeze(1)

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor,
        batch: ForwardBatch | None = None,
    ) -> torch.Tensor:
        """No batch: the no-cache forward over whole sequences (ground truth). With a batch: one cached step,
        the cache reached only through `batch.attn_backend`."""
        t = x.shape[0]
        h, d = self.num_heads, self.head_dim
        qkv, f_a, b, gate = self.projections(x)
        g = kda_gate(self.f_b_proj(f_a).view(t, h, d), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(b.float())

        if batch is None:
            qkv, _ = causal_conv1d(qkv, self.conv_weight(), cu_seqlens=cu_seqlens)
            q, k, v = (z.view(t, h, d) for z in qkv.split(h * d, dim=-1))
            o, _ = kda_chunked(l2norm(q), l2norm(k), v, g, beta, cu_seqlens=cu_seqlens)
        else:
            backend = batch.attn_backend
            assert backend is not None, "a cached step needs the batch's attention backend"
            qkv = backend.short_conv(self.kda_index, qkv, self.conv_weight())
            q, k, v = (z.view(t, h, d) for z in qkv.split(h * d, dim=-1))
            o = backend.kda(self.kda_index, l2norm(q), l2norm(k), v, g, beta)

        o = gated_rms_norm(o, gate.view(t, h, d), self.o_norm.weight, self.eps)
        return self.o_proj(o.reshape(t, h * d))

