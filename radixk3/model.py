"""The Kimi causal LM (both checkpoint formats): pre-norm decoder layers of KDA or MLA attention and a dense
MLP or MoE, with the additive residual or K3's Block Attention Residuals, and optional MTP layers.

Two entry points share every op:
- `forward(input_ids, cu_seqlens)`: the full-sequence, no-cache forward. This is ground truth.
- `forward_batch(batch, cache)`: one cached step (a `ForwardMode`: extend, decode, verify or idle); the layers
  reach the cache only through the attention backend it attaches to the batch.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from radixk3.attention_backend import AttentionBackend
from radixk3.attn_res import attn_res_forward
from radixk3.config import ConfigError, ModelConfig
from radixk3.decoder_layer import DecoderLayer
from radixk3.forward_batch import EmbeddingOverride, ForwardBatch, ForwardMode, HybridCache
from radixk3.layers import RMSNorm
from radixk3.mtp import MTPLayer, MTPOutput, run_mtp_layer
from radixk3.packed_experts import PACKED_ATTRS
from radixk3.parallel import parallel_state
from radixk3.parallel_linear import ParallelLMHead, VocabParallelEmbedding
from radixk3.tensor_names import public_shards, public_tensors

# Tensors that stay fp32 whatever the model dtype (as the reference implementations keep them).
FP32_PARAM_SUFFIXES = ("A_log", "dt_bias", "gate.weight", "gate.e_score_correction_bias")
# K3 also keeps the short-conv weights in fp32 (the conv runs in the activation dtype either way).
K3_FP32_PARAM_SUFFIXES = (*FP32_PARAM_SUFFIXES, "conv1d.weight")


def fp32_suffixes(cfg: ModelConfig) -> tuple[str, ...]:
    return K3_FP32_PARAM_SUFFIXES if cfg.is_k3_format else FP32_PARAM_SUFFIXES


class KimiModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        attn_res = cfg.attn_res_block_size is not None
        self.attn_res_block_size = cfg.attn_res_block_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, attn_res=attn_res) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if attn_res:
            self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(cfg.hidden_size, 1, bias=False)
        # Checkpoint layers num_hidden_layers + i; empty (no tensors) without MTP.
        self.mtp_layers = nn.ModuleList(MTPLayer(cfg, i) for i in range(cfg.num_nextn_predict_layers))


def check_tensor_parallel(cfg: ModelConfig, tp: int, attn_tp: int | None = None) -> None:
    """A clear error, before any layer is built, when `cfg`'s heads do not split over the `attn_tp` ranks of an
    attention group (default `tp`: no DP attention) or its dense dims over `tp` ranks (the MoE checks its own)."""
    attn_tp = tp if attn_tp is None else attn_tp
    flag = f"--tp {tp}" if attn_tp == tp else f"--tp / --dp = {attn_tp}"
    for key, n in (("kda_num_heads", cfg.kda_num_heads), ("num_attention_heads", cfg.num_attention_heads)):
        if n % attn_tp:
            raise ConfigError(f"{flag} must divide {key} ({n})")
    if cfg.intermediate_size % tp:
        raise ConfigError(f"--tp {tp} must divide intermediate_size ({cfg.intermediate_size})")


class KimiForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        state = parallel_state()
        check_tensor_parallel(cfg, state.tp_size, state.attn_tp_size)
        self.dp_attention = state.dp_attention
        self.config = cfg
        self.quantization: str | None = None  # weight-only int8 / int4 (`weight_quant.quantize_model_`)
        self.model = KimiModel(cfg)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @torch.inference_mode()
    def prenorm_hidden(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        batch: ForwardBatch | None = None,
        aux: dict[int, torch.Tensor] | None = None,
        embeds: EmbeddingOverride | None = None,
    ) -> torch.Tensor:
        """The final hidden state before `model.norm` (what MTP layers read). `aux`: keys are layer ids whose
        output state this fills (DSpark's target states: the AttnRes partial sum, or the residual stream).
        `embeds`: rows that replace some tokens' embeddings (images), when no `batch` carries them."""
        return self._prenorm_hidden(input_ids, cu_seqlens, batch, aux, embeds)

    def _prenorm_hidden(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        batch: ForwardBatch | None = None,
        aux: dict[int, torch.Tensor] | None = None,
        embeds: EmbeddingOverride | None = None,
    ) -> torch.Tensor:
        """`prenorm_hidden` outside inference mode: the no-cache path that training differentiates."""
        x = self.model.embed_tokens(input_ids)
        override = batch.embeds if batch is not None else embeds
        if override is not None:
            x = override.apply(x)
        block = self.model.attn_res_block_size
        if block is not None:
            return attn_res_forward(x, list(self.model.layers), block, self.model.output_attn_res_norm,
                                    self.model.output_attn_res_proj, cu_seqlens, batch, aux)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cu_seqlens, batch)
            if aux is not None and i in aux:
                aux[i] = x
        return x

    def hidden(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        batch: ForwardBatch | None = None,
        aux: dict[int, torch.Tensor] | None = None,
        embeds: EmbeddingOverride | None = None,
    ) -> torch.Tensor:
        return self.model.norm(self.prenorm_hidden(input_ids, cu_seqlens, batch, aux, embeds))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                embeds: EmbeddingOverride | None = None) -> torch.Tensor:
        """No-cache forward. input_ids [B, T] -> logits [B, T, V]; or packed [T] with cu_seqlens -> [T, V].
        `embeds` replaces some (flattened) tokens' embeddings: an image's rows at its pad positions."""
        if input_ids.dim() == 2:
            b, t = input_ids.shape
            cu = torch.arange(0, (b + 1) * t, t, device=input_ids.device)
            return self.lm_head(self.hidden(input_ids.reshape(-1), cu, embeds=embeds)).view(b, t, -1)
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, input_ids.numel()], device=input_ids.device)
        return self.lm_head(self.hidden(input_ids, cu_seqlens, embeds=embeds))

    @torch.inference_mode()
    def forward_batch(
        self, batch: ForwardBatch, cache: HybridCache, aux: dict[int, torch.Tensor] | None = None,
        prenorm: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One cached step; returns logits [M, V] for `batch.logits_index` (default: each sequence's last token).
        `aux` as for `prenorm_hidden`: the new tokens' states [T, hidden] after the layers it names. `prenorm`:
        a list that receives every new token's pre-norm final hidden [T, hidden] (what MTP layers read)."""
        if batch.mode is ForwardMode.IDLE:
            if self.dp_attention:
                self.idle_step()
            return self.lm_head.weight.new_empty(0, self.config.vocab_size)
        batch = dataclasses.replace(batch, attn_backend=AttentionBackend(batch, cache))
        pre = self.prenorm_hidden(batch.input_ids, batch.cu_seqlens, batch, aux)
        if prenorm is not None:
            prenorm.append(pre)
        h = self.model.norm(pre)
        rows = batch.logits_index if batch.logits_index is not None else batch.last_token_index()
        return self.lm_head(h[rows])

    @torch.inference_mode()
    def idle_step(self, mtp_index: int | None = None) -> None:
        """DP attention, a rank whose group has no tokens this step: run the layers on zero rows, so that it
        joins every FFN collective of the groups that do (the target's layers, or MTP layer `mtp_index`)."""
        ids = torch.zeros(0, dtype=torch.long, device=self.device)
        cu = torch.zeros(1, dtype=torch.int32, device=self.device)
        if mtp_index is None:
            self._prenorm_hidden(ids, cu)
        else:
            hidden = self.lm_head.weight.new_zeros(0, self.config.hidden_size)
            run_mtp_layer(self.model.mtp_layers, mtp_index, ids, hidden, cu, None)

    # --- MTP layers ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward_mtp(
        self, index: int, next_ids: torch.Tensor, hidden: torch.Tensor, cu_seqlens: torch.Tensor | None = None
    ) -> MTPOutput:
        """No-cache MTP layer `index` over packed pairs (next_ids [T], hidden [T, H]: the token after each
        position and the pre-norm hidden state there); logits at every position."""
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, next_ids.numel()], device=next_ids.device)
        out = run_mtp_layer(self.model.mtp_layers, index, next_ids, hidden, cu_seqlens, None)
        return MTPOutput(out, self.mtp_logits(index, out))

    @torch.inference_mode()
    def forward_mtp_batch(
        self, index: int, batch: ForwardBatch, hidden: torch.Tensor, cache: HybridCache
    ) -> MTPOutput:
        """One cached MTP step: `batch.input_ids` are the next tokens, `cache` the MTP cache
        (`allocate_mtp_cache`); logits for `batch.logits_index` (default: each sequence's last token)."""
        if batch.mode is ForwardMode.IDLE:
            if self.dp_attention:
                self.idle_step(index)
            return MTPOutput(hidden[:0], self.lm_head.weight.new_empty(0, self.config.vocab_size))
        batch = dataclasses.replace(batch, attn_backend=AttentionBackend(batch, cache))
        out = run_mtp_layer(self.model.mtp_layers, index, batch.input_ids, hidden, batch.cu_seqlens, batch)
        rows = batch.logits_index if batch.logits_index is not None else batch.last_token_index()
        return MTPOutput(out, self.mtp_logits(index, out[rows]))

    def mtp_logits(self, index: int, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.mtp_layers[index].shared_head.norm(out))

    def cast_(self, dtype: torch.dtype) -> KimiForCausalLM:
        """Cast to `dtype`, keeping the tensors that the references hold in fp32 in fp32."""
        if self.quantization is not None:
            raise ValueError(f"cast the model before quantising it ({self.quantization}): its scales are made for "
                             "its dtype")
        keep = fp32_suffixes(self.config)
        for name, p in self.named_parameters():
            p.data = p.data.float() if name.endswith(keep) else p.data.to(dtype)
        for name, b in self.named_buffers():
            if name.rsplit(".", 1)[-1] in PACKED_ATTRS:
                continue  # packed expert weights keep the checkpoint's storage
            b.data = b.data.float() if name.endswith(keep) else b.data.to(dtype)
        return self


def _draw(name: str, shape: tuple[int, ...], gen: torch.Generator, safe_gate: bool) -> torch.Tensor:
    """Seeded values of public tensor `name` at its full `shape` (fan-in from the full shape)."""
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1, 16, generator=gen).log()
    if name.endswith("dt_bias") and safe_gate:
        # lb * sigmoid(exp(A_log) (f + dt_bias)): a bias in (-3, -1) gives mostly mild decays and some
        # up to the bound (Mamba's dt_bias, near -5, would leave the safe gate at ~0: no decay at all).
        return torch.empty(shape).uniform_(-3, -1, generator=gen)
    if name.endswith("dt_bias"):
        # Inverse softplus of dt ~ logU(1e-3, 1e-1), as Mamba/fla initialise it.
        dt = torch.exp(torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
        return dt + torch.log(-torch.expm1(-dt))
    if "norm" in name:
        return 1 + 0.1 * torch.randn(shape, generator=gen)
    if "conv1d" in name:
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    if name.endswith("res_proj.weight"):
        # AttnRes pseudo-queries train from zero (uniform mixing); small random ones keep the softmax
        # non-uniform without the peaked mixtures that make a random network amplify rounding.
        return 0.3 * torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])  # linear [out, in]


@torch.no_grad()
def init_random_(model: KimiForCausalLM, seed: int) -> KimiForCausalLM:
    """Seeded random weights with healthy activations: fan-in scaled linears, fla-style decay parameters.
    Drawn per public (checkpoint) tensor in name order, into views of the fused parameters: the values for a
    seed do not depend on how the model fuses its projections or stacks its experts. Under TP every public
    tensor is drawn at its full shape, in the same order, and this rank keeps its part (`Shard.index`; the
    tensors other ranks hold alone are drawn and dropped), so a sharded model is exactly a shard of the
    unsharded one."""
    gen = torch.Generator().manual_seed(seed)
    safe_gate = model.config.kda_gate_lower_bound is not None
    views = public_tensors(model, params_only=True)
    shards = public_shards(model)
    remote = {n for n, s in shards.items() if s.index is None}
    for name in sorted(set(views) | remote):
        shard = shards.get(name)
        full = _draw(name, shard.full_shape if shard else tuple(views[name].shape), gen, safe_gate)
        if shard is None:
            views[name].copy_(full)
        elif shard.index is not None:
            views[name].copy_(full[shard.index])
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
