"""K3's multi-token-prediction (MTP) layers: checkpoint layers num_hidden_layers + i, each a normal decoder
layer (MLA, since its index is not a KDA layer; MoE or dense by the usual rule; additive residual, no Attention
Residuals) behind an input fusion, as vLLM's `KimiK3MTPModel` runs them:

    x = eh_proj([enorm(embed(t_next)) zeroed at position 0 ; hnorm(h)])
    out = layer(x);  logits = lm_head(shared_head.norm(out))

h is the target's pre-norm final hidden state at the same position (or the previous MTP step's `out`), t_next the
token after that position. The target's `lm_head` replaces `shared_head.head` (vLLM always swaps it; the tensor is
still loaded), and `embed_tokens` is held by the first MTP layer only and shared by all. MTP layers keep their
own latent KV, in a separate `HybridCache` with one latent tensor per MTP layer (`allocate_mtp_cache`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from kernels.pool_slots import window_positions
from radixk3.config import ModelConfig
from radixk3.decoder_layer import DecoderLayer
from radixk3.forward_batch import ForwardBatch, HybridCache
from radixk3.layers import RMSNorm
from radixk3.parallel_linear import Linear, ParallelLMHead, VocabParallelEmbedding


class MTPOutput(NamedTuple):
    hidden: torch.Tensor  # [T, hidden] pre-norm output of the MTP layer (the next step's h)
    logits: torch.Tensor  # [M, vocab]


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)  # loaded, never run: lm_head replaces it


class MTPLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__(cfg, cfg.num_hidden_layers + index, attn_res=False, mla_index=index)
        hid = cfg.hidden_size
        self.enorm = RMSNorm(hid, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hid, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * hid, hid)
        self.shared_head = SharedHead(cfg)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, hid) if index == 0 else None

    def fuse(self, embedded: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        embedded = embedded.masked_fill((positions == 0).unsqueeze(-1), 0)
        return self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))


def token_positions(cu_seqlens: torch.Tensor, prefix_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Absolute position of every packed token: its offset in its sequence's new tokens plus the prefix."""
    seq, pos, _ = window_positions(cu_seqlens, int(cu_seqlens[-1]))
    return pos if prefix_lens is None else pos + prefix_lens[seq]


def allocate_mtp_cache(cfg: ModelConfig, num_kv_slots: int, device: torch.device | str = "cpu") -> HybridCache:
    """The MTP layers' latent KV: the same `HybridCache` type, with no KDA state and one latent per MTP layer."""
    return HybridCache(
        recurrent=[],
        conv=[],
        latent=[torch.zeros(num_kv_slots, cfg.kv_dim, dtype=cfg.torch_dtype, device=device)
                for _ in range(cfg.num_nextn_predict_layers)],
    )


def run_mtp_layer(
    layers: nn.ModuleList,
    index: int,
    next_ids: torch.Tensor,
    hidden: torch.Tensor,
    cu_seqlens: torch.Tensor,
    batch: ForwardBatch | None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """MTP layer `index` on packed (next token, h) pairs; returns its pre-norm output [T, hidden]. `positions`:
    each pair's absolute position, when the caller has them (a captured step: computing them reads the host)."""
    layer: MTPLayer = layers[index]
    embed = layers[0].embed_tokens
    if positions is None:
        positions = token_positions(cu_seqlens, None if batch is None else batch.prefix_lens)
    x = layer.fuse(embed(next_ids), hidden.to(embed.weight.dtype), positions)
    return layer(x, cu_seqlens, batch)
