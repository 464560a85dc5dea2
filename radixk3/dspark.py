"""K3's DSpark parallel drafter (vLLM method `dspark`): N draft tokens from one block-non-causal pass.

One drafting step for a request whose target has run positions [0, L) and sampled the anchor (position L):
1. Context: the target's aux states at `target_layer_ids` (AttnRes partial sum p after layer i, or the residual
   stream; `target_aux_states`), concatenated per token -> context_proj -> context_norm -> for every draft
   layer only its K/V: kv_a_proj_with_mqa -> kv_a_layernorm on c_kv, RoPE on k_pe at the context position.
   That row [kv_lora_rank + rope_dim] is what an MLA latent cache stores (`context_latents`).
2. Block: anchor + N-1 noise tokens at positions L..L+N-1, embedded with the target's embedding; each draft
   layer is pre-norm MLA with RoPE (q-LoRA, no gate) + SwiGLU MLP, and the block attends to all context
   positions and NON-causally to itself (its own K/V from its hidden states, as normal MLA).
3. Base logits at all N positions (target lm_head after final_norm), then the Markov head, sequentially:
   prev = anchor; tok_i = choose(l_i + markov_w2(markov_w1[prev])); prev = tok_i (`markov_draft`).
sample_from_anchor=True: block position i (the anchor is i = 0) predicts the token at L+1+i, so a block of N
gives N drafts. The draft distribution q_i = softmax(l_i + markov term) is returned for rejection sampling.

RoPE is DeepSeek's (non-NeoX: rotated pairs are adjacent dims), no scaling, at `rope_theta`. The embedding and
lm_head are the target's, held by reference (never in this model's state dict, never trained here).
Cached drafting (`draft_block_paged`) keeps the context latents in a `HybridCache` with one latent tensor per
draft layer (`allocate_dspark_cache`); the block's own latents are written at positions L..L+N-1 of the same
page table, where the next step's context latents of the accepted tokens overwrite them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from kernels.mla import mla_attention
from kernels.mla_paged import mla_paged_prefill, mla_store
from kernels.paged_kv import PagedKV, paged_slots
from radixk3.dspark_config import DSparkConfig
from radixk3.forward_batch import ForwardBatch, HybridCache
from radixk3.layers import MLP, RMSNorm
from radixk3.model import KimiForCausalLM


class DraftPass(NamedTuple):
    logits: Tensor  # [N, block, V] base logits (before the Markov term)
    hidden: Tensor  # [N, block, hidden] after final_norm


class MarkovDraft(NamedTuple):
    tokens: Tensor  # [N, block] drafts: tokens[:, i] is the guess for position L+1+i
    probs: Tensor  # [N, block, V] the draft distribution q each token was chosen from (fp32)


def apply_rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotate x [T, ..., D] at positions [T]: DeepSeek's pairs (2i, 2i+1) by angle p * theta^(-2i/D)."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = positions.to(torch.float32)[:, None] * inv_freq  # [T, D/2]
    ang = ang.view(ang.shape[0], *([1] * (x.dim() - 2)), d // 2)
    cos, sin = ang.cos(), ang.sin()
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2).to(x.dtype)


class DSparkAttention(nn.Module):
    """MLA with RoPE and q-LoRA (no output gate), under DeepseekV3's tensor names."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        hid, h = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads, self.theta = h, cfg.rope_theta
        self.nope, self.rope, self.v_dim, self.kv_lora_rank = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                              cfg.v_head_dim, cfg.kv_lora_rank)
        self.scale = (self.nope + self.rope) ** -0.5
        self.q_a_proj = nn.Linear(hid, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hid, cfg.kv_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, hid, bias=False)

    def latent(self, x: Tensor, positions: Tensor) -> Tensor:
        """The cache row of each token: [kv_a_layernorm(c_kv) | RoPE(k_pe)], [T, kv_dim]."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        return torch.cat([self.kv_a_layernorm(c_kv), apply_rope(k_pe, positions, self.theta)], dim=-1)

    def query(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(x.shape[0], self.num_heads, -1)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        return q_nope, apply_rope(q_pe, positions, self.theta)


class DSparkLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DSparkAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)


# (draft layer index, its attention, q_nope, rotated q_pe, the block's latents) -> o [T, H, Dv]
Attend = Callable[[int, DSparkAttention, Tensor, Tensor, Tensor], Tensor]


class _Aliased(NamedTuple):
    embed: nn.Embedding
    lm_head: nn.Linear


class DSparkModel(nn.Module):
    def __init__(self, cfg: DSparkConfig, target: KimiForCausalLM) -> None:
        super().__init__()
        cfg.check_target(target.config)
        self.config = cfg
        self.layers = nn.ModuleList(DSparkLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.context_proj = nn.Linear(cfg.aux_dim, cfg.hidden_size, bias=False)
        self.context_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.markov_w1 = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
        self.markov_w2 = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)
        # A plain tuple attribute: not registered, so neither saved, loaded nor trained with this model.
        self.target = _Aliased(target.model.embed_tokens, target.lm_head)

    # --- step 1: context latents --------------------------------------------------------------------
    def context_latents(self, aux: Tensor, positions: Tensor) -> list[Tensor]:
        """aux [T, n_ids * H_t] (`target_aux_states`), positions [T] -> per draft layer [T, kv_dim]."""
        c = self.context_norm(self.context_proj(aux.to(self.context_proj.weight.dtype)))
        return [layer.self_attn.latent(c, positions) for layer in self.layers]

    # --- step 2/3: the block --------------------------------------------------------------------------
    def block_inputs(self, anchors: Tensor, context_lens: Tensor, block: int | None = None) -> tuple[Tensor, Tensor]:
        """Embedded block tokens [N*B, H] (anchor, then noise) and their positions [N*B]; B = `block`, by
        default the config's `block_size`."""
        n, b = anchors.numel(), block or self.config.block_size
        ids = torch.full((n, b), self.config.dspark_noise_token_id, dtype=torch.int64, device=anchors.device)
        ids[:, 0] = anchors
        pos = context_lens.to(anchors.device)[:, None] + torch.arange(b, device=anchors.device)
        # The aliased target modules (vocab-parallel under --tp); training freezes the target's weights.
        x = self.target.embed(ids.reshape(-1))
        return x.to(self.final_norm.weight.dtype), pos.reshape(-1)

    def _run_layers(self, x: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            attn = layer.self_attn
            q_nope, q_pe = attn.query(h, positions)
            o = attend(i, attn, q_nope, q_pe, attn.latent(h, positions))
            x = x + attn.o_proj(o.reshape(x.shape[0], -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.final_norm(x)

    def _finish(self, h: Tensor, n: int) -> DraftPass:
        h = h.view(n, -1, h.shape[-1])
        head = self.target.lm_head  # vocab-parallel under --tp: its forward gathers the whole vocabulary
        return DraftPass(head(h.to(head.weight.dtype)), h)

    def draft_block(self, context: Sequence[Tensor], cu_context: Tensor, anchors: Tensor,
                    block: int | None = None) -> DraftPass:
        """No-cache reference pass. context: per draft layer the packed context latents [sum L_i, kv_dim] of N
        sequences (`context_latents` at positions 0..L_i-1), cu_context [N+1]; anchors [N] (position L_i);
        `block` tokens per sequence (default: `block_size`)."""
        n, b = anchors.numel(), block or self.config.block_size
        dev = anchors.device
        lens = cu_context[1:] - cu_context[:-1]
        x, positions = self.block_inputs(anchors, lens, b)
        total_ctx = int(cu_context[-1])
        # kv of sequence i: its context rows, then its block rows (stored after all context rows).
        seq = torch.repeat_interleave(torch.arange(n, device=dev), lens + b)
        cu_kv = torch.cat([lens.new_zeros(1), torch.cumsum(lens + b, 0)])
        off = torch.arange(int(cu_kv[-1]), device=dev) - cu_kv[:-1][seq]
        rows = torch.where(off < lens[seq], cu_context[:-1][seq] + off, total_ctx + seq * b + off - lens[seq])
        cu_q = torch.arange(0, (n + 1) * b, b, device=dev)

        def attend(i: int, attn: DSparkAttention, q_nope: Tensor, q_pe: Tensor, lat: Tensor) -> Tensor:
            buf = torch.cat([context[i].to(lat.dtype), lat])
            return mla_attention(q_nope, q_pe, buf, attn.kv_b_proj.weight, cu_q=cu_q, cu_kv=cu_kv,
                                 scale=attn.scale, kv_rows=rows, causal=False)

        return self._finish(self._run_layers(x, positions, attend), n)

    def draft_block_paged(self, anchors: Tensor, cache: HybridCache, block_table: Tensor, context_lens: Tensor,
                          page_size: int, block: int | None = None) -> DraftPass:
        """Cached pass: positions [0, L_i) of each sequence hold context latents in `cache` (`store_context`);
        the block's latents are stored at positions L_i..L_i+B-1 (the table must cover them), then the block
        attends over all L_i + B rows non-causally (`mla_paged_prefill(causal=False)`)."""
        n, b = anchors.numel(), block or self.config.block_size
        dev = anchors.device
        lens = context_lens.to(dev)
        x, positions = self.block_inputs(anchors, lens, b)
        seq = torch.arange(n, device=dev).repeat_interleave(b)
        slots = paged_slots(block_table, seq, positions, page_size)
        paged = PagedKV(block_table, lens + b, page_size)
        cu_q = torch.arange(0, (n + 1) * b, b, device=dev)

        def attend(i: int, attn: DSparkAttention, q_nope: Tensor, q_pe: Tensor, lat: Tensor) -> Tensor:
            mla_store(cache.latent[i], slots, lat, validate=i == 0)
            return mla_paged_prefill(q_nope, q_pe, cache.latent[i], attn.kv_b_proj.weight, paged, cu_q=cu_q,
                                     scale=attn.scale, validate=i == 0, causal=False)

        return self._finish(self._run_layers(x, positions, attend), n)

    # --- step 3: the Markov head ------------------------------------------------------------------------
    def markov_logits(self, base: Tensor, prev: Tensor) -> Tensor:
        """l + markov_w2(markov_w1[prev]): base [..., V], prev [...] -> fp32 [..., V]."""
        return base.float() + self.markov_w2(self.markov_w1(prev)).float()

    def markov_draft(self, base_logits: Tensor, anchors: Tensor, *, greedy: bool = True, temperature: float = 1.0,
                     generator: torch.Generator | None = None) -> MarkovDraft:
        """Sequential choice over the block: prev = anchor; tok_i = argmax (or a draw from softmax(./T)) of
        l_i + markov(prev); prev = tok_i. q_i is the distribution drawn from (greedy: at temperature 1)."""
        n, b, _ = base_logits.shape
        prev = anchors
        tokens, probs = [], []
        for i in range(b):
            logits = self.markov_logits(base_logits[:, i], prev)
            q = (logits / (1.0 if greedy else temperature)).softmax(-1)
            tok = logits.argmax(-1) if greedy else torch.multinomial(q, 1, generator=generator).squeeze(-1)
            tokens.append(tok)
            probs.append(q)
            prev = tok
        return MarkovDraft(torch.stack(tokens, 1), torch.stack(probs, 1))

    def draft(self, context: Sequence[Tensor], cu_context: Tensor, anchors: Tensor, *, greedy: bool = True,
              temperature: float = 1.0, generator: torch.Generator | None = None,
              block: int | None = None) -> MarkovDraft:
        """`draft_block` then `markov_draft` (no-cache, greedy by default)."""
        base = self.draft_block(context, cu_context, anchors, block).logits
        return self.markov_draft(base, anchors, greedy=greedy, temperature=temperature, generator=generator)


# --- the target side ------------------------------------------------------------------------------------
def aux_request(cfg: DSparkConfig) -> dict[int, Tensor]:
    """The `aux` dict to pass to the target's `prenorm_hidden` / `forward_batch`: filled per target layer."""
    return dict.fromkeys(cfg.target_layer_ids, torch.empty(0))


def concat_aux(cfg: DSparkConfig, aux: dict[int, Tensor]) -> Tensor:
    """The filled `aux` as DSpark's context input [T, n_ids * H_t], in `target_layer_ids` order."""
    missing = [i for i in cfg.target_layer_ids if aux.get(i) is None or aux[i].numel() == 0]
    if missing:
        raise ValueError(f"target layers {missing} were not captured")
    return torch.cat([aux[i] for i in cfg.target_layer_ids], dim=-1)


def target_aux_states(target: KimiForCausalLM, cfg: DSparkConfig, input_ids: Tensor, cu_seqlens: Tensor,
                      batch: ForwardBatch | None = None) -> Tensor:
    """The target's aux states of packed tokens [T, n_ids * H_t] from its no-cache forward."""
    aux = aux_request(cfg)
    target.prenorm_hidden(input_ids, cu_seqlens, batch, aux)
    return concat_aux(cfg, aux)


def allocate_dspark_cache(cfg: DSparkConfig, num_kv_slots: int, device: torch.device | str = "cpu") -> HybridCache:
    """The drafter's context latents: no KDA state, one latent tensor per draft layer."""
    return HybridCache(recurrent=[], conv=[], latent=[
        torch.zeros(num_kv_slots, cfg.kv_dim, dtype=cfg.torch_dtype, device=device)
        for _ in range(cfg.num_hidden_layers)])


def store_context(cache: HybridCache, latents: Sequence[Tensor], slots: Tensor) -> None:
    """Write per-layer context latents [T, kv_dim] at KV slots [T] (the tokens' positions in the page table)."""
    for i, lat in enumerate(latents):
        mla_store(cache.latent[i], slots, lat, validate=i == 0)
