"""MLA layer with NoPE: per token, only the latent [c_kv | k_pe] is cached.

No rotary embedding anywhere: the `rope` dims exist but are used unrotated, so attention depends on token order
only through the causal mask, and positions never enter the cache. Queries come from a full-rank `q_proj` or
the q-LoRA path q_b(RMSNorm(q_a x)). K3's Gated MLA (`mla_use_output_gate`) multiplies the attention output by
sigmoid(g_proj x) before o_proj (`g_proj` [H*v_head_dim, hidden], a different tensor from KDA's `g_proj`).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.mla import mla_attention
from radixk3.config import ModelConfig
from radixk3.forward_batch import ForwardBatch
from radixk3.layers import RMSNorm
from radixk3.parallel import parallel_state
from radixk3.parallel_linear import ColumnParallelLinear, Linear, RowParallelLinear


class MLAAttention(nn.Module):
    """Under TP the query heads are split (q_proj or q_b_proj, kv_b_proj and the Gated-MLA g_proj by head;
    o_proj row-parallel); q_a / kv_a and their norms are replicated, so every rank computes, stores and reads
    the whole latent of every token (the latent KV is not sharded, as SGLang does for MLA)."""

    def __init__(self, cfg: ModelConfig, mla_index: int) -> None:
        super().__init__()
        hid, h = cfg.hidden_size, cfg.num_attention_heads
        self.mla_index = mla_index
        self.num_heads = h // parallel_state().tp_size
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = (self.nope + self.rope) ** -0.5
        q_dim = h * (self.nope + self.rope)
        qk = self.nope + self.rope
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hid, q_dim, unit=qk)
        else:
            self.q_a_proj = Linear(hid, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.mla_q_norm_eps)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, q_dim, unit=qk)
        self.kv_a_proj_with_mqa = Linear(hid, cfg.kv_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.mla_kv_norm_eps)
        kv_b_rows = self.nope + self.v_dim  # per head
        self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, h * kv_b_rows, unit=kv_b_rows)
        self.o_proj = RowParallelLinear(h * self.v_dim, hid, unit=self.v_dim)
        self.g_proj = ColumnParallelLinear(hid, h * self.v_dim, unit=self.v_dim) if cfg.mla_use_output_gate else None

    def query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor,
        batch: ForwardBatch | None = None,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.query(x).view(t, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)
        if batch is None:
            o = mla_attention(q_nope, q_pe, latent, self.kv_b_proj.weight, cu_q=cu_seqlens, cu_kv=cu_seqlens,
                              scale=self.scale, absorbed=False)
        else:
            assert batch.attn_backend is not None, "a cached step needs the batch's attention backend"
            o = batch.attn_backend.mla(self.mla_index, q_nope, q_pe, latent, self.kv_b_proj.weight, self.scale)
        o = o.reshape(t, self.num_heads * self.v_dim)
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)
