"""The Kimi-Linear-format causal LM: pre-norm decoder layers of KDA or MLA attention and a dense MLP or MoE.

Two entry points share every op:
- `forward(input_ids, cu_seqlens)`: the full-sequence, no-cache forward. This is ground truth.
- `forward_batch(batch, cache)`: one cached step (prefill chunks and decodes) reading and writing `HybridCache`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from radixk3.config import ModelConfig
from radixk3.forward_batch import ForwardBatch, HybridCache
from radixk3.kda_attention import KDAAttention
from radixk3.layers import MLP, MoE, RMSNorm
from radixk3.mla_attention import MLAAttention

# Tensors that stay fp32 whatever the model dtype (as the reference implementations keep them).
FP32_PARAM_SUFFIXES = ("A_log", "dt_bias", "gate.weight", "gate.e_score_correction_bias")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn: KDAAttention | MLAAttention
        if cfg.is_kda(layer):
            self.self_attn = KDAAttention(cfg, cfg.kda_layers.index(layer))
        else:
            self.self_attn = MLAAttention(cfg, cfg.mla_layers.index(layer))
        self.is_moe = cfg.is_moe(layer)
        # The checkpoint names the FFN `block_sparse_moe` in MoE layers and `mlp` in dense ones.
        if self.is_moe:
            self.block_sparse_moe = MoE(cfg)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor, batch: ForwardBatch | None, cache: HybridCache | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cu_seqlens, batch, cache)
        ffn = self.block_sparse_moe if self.is_moe else self.mlp
        return x + ffn(self.post_attention_layernorm(x))


class KimiModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class KimiForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = KimiModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def hidden(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        batch: ForwardBatch | None = None,
        cache: HybridCache | None = None,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cu_seqlens, batch, cache)
        return self.model.norm(x)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """No-cache forward. input_ids [B, T] -> logits [B, T, V]; or packed [T] with cu_seqlens -> [T, V]."""
        if input_ids.dim() == 2:
            b, t = input_ids.shape
            cu = torch.arange(0, (b + 1) * t, t, device=input_ids.device)
            return self.lm_head(self.hidden(input_ids.reshape(-1), cu)).view(b, t, -1)
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, input_ids.numel()], device=input_ids.device)
        return self.lm_head(self.hidden(input_ids, cu_seqlens))

    @torch.inference_mode()
    def forward_batch(self, batch: ForwardBatch, cache: HybridCache) -> torch.Tensor:
        """One cached step; returns logits [M, V] for `batch.logits_index` (default: each sequence's last token)."""
        h = self.hidden(batch.input_ids, batch.cu_seqlens, batch, cache)
        rows = batch.logits_index if batch.logits_index is not None else batch.last_token_index()
        return self.lm_head(h[rows])

    def cast_(self, dtype: torch.dtype) -> KimiForCausalLM:
        """Cast to `dtype`, keeping the gate/decay tensors that the references hold in fp32 in fp32."""
        for name, p in self.named_parameters():
            p.data = p.data.float() if name.endswith(FP32_PARAM_SUFFIXES) else p.data.to(dtype)
        for name, b in self.named_buffers():
            b.data = b.data.float() if name.endswith(FP32_PARAM_SUFFIXES) else b.data.to(dtype)
        return self


@torch.no_grad()
def init_random_(model: KimiForCausalLM, seed: int) -> KimiForCausalLM:
    """Seeded random weights with healthy activations: fan-in scaled linears, fla-style decay parameters."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
        elif name.endswith("dt_bias"):
            # Inverse softplus of dt ~ logU(1e-3, 1e-1), as Mamba/fla initialise it.
            dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif "norm" in name:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        elif "conv1d" in name:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        elif name.endswith("embed_tokens.weight"):
            p.copy_(torch.randn(p.shape, generator=gen))
        else:  # linear [out, in]
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    for name, b in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model


def build_model(cfg: ModelConfig, seed: int | None = None, device: torch.device | str = "cpu") -> KimiForCausalLM:
    """A model of `cfg` (random weights when `seed` is given; otherwise to be filled by the loader)."""
    model = KimiForCausalLM(cfg)
    if seed is not None:
        init_random_(model, seed)
    return model.cast_(cfg.torch_dtype).to(device).eval()
