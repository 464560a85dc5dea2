"""Block Attention Residuals (K3, `attn_res_block_size` B): every sublayer reads a softmax mixture of block
summaries instead of the running residual sum.

State of one forward, per token: a bank of block summaries R (b_0 = the embedding, b_n = the sum of the
sublayer outputs of block n-1) and the partial sum p of the current block. For a source set S and a pseudo-query
(norm gamma, proj w [1, hidden]): alpha_s = softmax_s(w . RMSNorm_gamma(s)), mix = sum_s alpha_s s over the raw
sources in fp32, and the sublayer reads RMSNorm_out(mix) with its own input/post-attention norm. Layer l:
1. p <- p + m_{l-1}, rounded once to the activation dtype (bf16 in K3); at l = 0, p = the embedding.
2. if l % B == 0: R[l / B] = p.
3. attention sources R[0 .. ceil(l/B) - 1] + {p}; a_l = Attn(...); p <- a_l at a write layer, else p + a_l.
4. MLP sources R[0 .. ceil(l/B) + [l % B == 0] - 1] + {p}; m_l = MLP(...).
5. after the last layer p <- p + m_{L-1}; h = mix(R + {p}) with `output_attn_res_{norm,proj}`, then model.norm.
Everything mixes over layer outputs of the same token, so there is no state across tokens and no cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from radixk3.decoder_layer import DecoderLayer
from radixk3.forward_batch import ForwardBatch
from radixk3.layers import RMSNorm


def mix_sources(sources: Sequence[torch.Tensor], norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """softmax_s(w . RMSNorm_gamma(s))-weighted sum of the raw sources [T, hidden] -> fp32 [T, hidden]."""
    s = torch.stack([x.float() for x in sources])  # [S, T, H]
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()
    alpha = (normed @ proj.weight.float()[0]).softmax(0)  # [S, T]
    return (alpha.unsqueeze(-1) * s).sum(0)


class BlockBank:
    """The block summaries R and the partial sum p of one forward (per token, packed)."""

    def __init__(self, embedding: torch.Tensor, block_size: int) -> None:
        self.block_size = block_size
        self.dtype = embedding.dtype
        self.blocks: list[torch.Tensor] = []
        self.partial = embedding
        self.layer = -1
        self.write = False

    def _add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a.float() + b.float()).to(self.dtype)

    def attention_sources(self, layer: int, prev_mlp_out: torch.Tensor | None) -> list[torch.Tensor]:
        if layer != self.layer + 1:
            raise ValueError(f"layer {layer} after layer {self.layer}: layers must run in order")
        self.layer = layer
        if prev_mlp_out is not None:
            self.partial = self._add(self.partial, prev_mlp_out)
        self.write = layer % self.block_size == 0
        if self.write:
            self.blocks.append(self.partial)
        # At a write layer the block just written is p itself, so it is not repeated from R.
        return self.blocks[: -(-layer // self.block_size)] + [self.partial]

    def mlp_sources(self, attn_out: torch.Tensor) -> list[torch.Tensor]:
        self.partial = attn_out.to(self.dtype) if self.write else self._add(self.partial, attn_out)
        return [*self.blocks, self.partial]

    def final_sources(self, last_mlp_out: torch.Tensor) -> list[torch.Tensor]:
        self.partial = self._add(self.partial, last_mlp_out)
        return [*self.blocks, self.partial]

    def check_integrity(self) -> None:
        expected = -(-(self.layer + 1) // self.block_size) if self.layer >= 0 else 0
        if len(self.blocks) != expected:
            raise AssertionError(f"{len(self.blocks)} blocks after layer {self.layer}, expected {expected}")
        for b in self.blocks:
            if b.shape != self.partial.shape or b.dtype != self.dtype:
                raise AssertionError("block summaries must match the partial sum's shape and dtype")


def attn_res_forward(
    embedding: torch.Tensor,
    layers: Sequence[DecoderLayer],
    block_size: int,
    out_norm: RMSNorm,
    out_proj: nn.Linear,
    cu_seqlens: torch.Tensor,
    batch: ForwardBatch | None,
    aux: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The decoder stack with Block Attention Residuals; returns the pre-norm hidden state h (activation dtype).
    `aux` (DSpark's target states): each key i is filled with the partial sum p after layer i (m_i included)."""
    bank = BlockBank(embedding, block_size)
    dtype = embedding.dtype
    mlp_out: torch.Tensor | None = None
    for i, layer in enumerate(layers):
        mix = mix_sources(bank.attention_sources(i, mlp_out), layer.self_attention_res_norm,
                          layer.self_attention_res_proj)
        attn_out = layer.attention(layer.input_layernorm(mix, dtype), cu_seqlens, batch)
        mix = mix_sources(bank.mlp_sources(attn_out), layer.mlp_res_norm, layer.mlp_res_proj)
        mlp_out = layer.feed_forward(layer.post_attention_layernorm(mix, dtype))
        if aux is not None and i in aux:
            aux[i] = bank._add(bank.partial, mlp_out)
    if mlp_out is None:
        raise ValueError("Attention Residuals need at least one layer")
    return mix_sources(bank.final_sources(mlp_out), out_norm, out_proj).to(dtype)
