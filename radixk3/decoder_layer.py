"""One pre-norm decoder layer: KDA or MLA attention, then a dense MLP or an MoE.

With the additive residual (Kimi-Linear, and K3's MTP layers) `forward` is the whole layer. With Block Attention
Residuals the model mixes each sublayer's input itself (`attn_res.py`) and calls `attention` / `feed_forward`
on the mixed, normed input; the layer then also holds the two pseudo-queries `self_attention_res_{norm,proj}`
and `mlp_res_{norm,proj}` (proj [1, hidden]).

DP attention (`parallel_state().dp_size` > 1 when built): the attention is built over this rank's attention
group and runs on its group's tokens only; the FFN is sharded over every rank and runs on every group's tokens:
`feed_forward` gathers them (`parallel.dp_gather`), runs the FFN, and keeps its own group's rows. A group with
no tokens (the idle batch) skips attention and still joins the FFN's collectives with zero rows.
"""

from __future__ import annotations

import torch
from torch import nn

from radixk3.config import ModelConfig
from radixk3.forward_batch import ForwardBatch
from radixk3.kda_attention import KDAAttention
from radixk3.layers import GLU, MLP, RMSNorm
from radixk3.mla_attention import MLAAttention
from radixk3.moe_layer import MoE
from radixk3.parallel import attention_tp, dp_gather, dp_scatter, parallel_state


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, attn_res: bool = False, mla_index: int | None = None) -> None:
        """`layer` is the checkpoint layer index (MTP layers: num_hidden_layers + i); `mla_index` overrides
        which of the cache's latent tensors an MLA layer uses (MTP layers have their own cache)."""
        super().__init__()
        hid, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(hid, eps)
        self.post_attention_layernorm = RMSNorm(hid, eps)
        self.self_attn: KDAAttention | MLAAttention
        self.dp_attention = parallel_state().dp_attention
        with attention_tp():
            if cfg.is_kda(layer):
                self.self_attn = KDAAttention(cfg, cfg.kda_layers.index(layer))
            else:
                self.self_attn = MLAAttention(cfg, cfg.mla_layers.index(layer) if mla_index is None else mla_index)
        self.is_moe = cfg.is_moe(layer)
        # The checkpoint names the FFN `block_sparse_moe` in MoE layers and `mlp` in dense ones.
        if self.is_moe:
            self.block_sparse_moe = MoE(cfg)
        else:
            self.mlp = MLP(hid, cfg.intermediate_size, GLU.of(cfg))
        if attn_res:
            self.self_attention_res_norm = RMSNorm(hid, eps)
            self.self_attention_res_proj = nn.Linear(hid, 1, bias=False)
            self.mlp_res_norm = RMSNorm(hid, eps)
            self.mlp_res_proj = nn.Linear(hid, 1, bias=False)

    def attention(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor, batch: ForwardBatch | None
    ) -> torch.Tensor:
        if x.shape[0] == 0:  # an idle batch (every rank of the attention group has none)
            return torch.zeros_like(x)
        return self.self_attn(x, cu_seqlens, batch)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        ffn = self.block_sparse_moe if self.is_moe else self.mlp
        if not self.dp_attention:
            return ffn(x)
        where = dp_gather(x)
        if where.rows.shape[0] == 0:  # every group idle (all ranks agree: the counts are global)
            return x
        return dp_scatter(ffn(where.rows), where)

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor, batch: ForwardBatch | None
    ) -> torch.Tensor:
        x = x + self.attention(self.input_layernorm(x), cu_seqlens, batch)
        return x + self.feed_forward(self.post_attention_layernorm(x))
