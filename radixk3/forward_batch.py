"""What one cached forward step needs: the batch layout and the cache tensors it reads and writes.

The cache tensors are per-layer and indexed by *physical* slot: a KDA state slot holds one sequence's recurrent
and conv state for that layer, a KV slot holds one token's MLA latent. They are either standalone tensors
(`HybridCache.allocate`) or views into the runtime's unified pool; the model does not care which.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixk3.config import ModelConfig


@dataclass
class HybridCache:
    recurrent: list[torch.Tensor]  # per KDA layer: [state_slots, H, K, V] fp32
    conv: list[torch.Tensor]  # per KDA layer: [state_slots, 3*H*D, conv_kernel - 1], model dtype
    latent: list[torch.Tensor]  # per MLA layer: [kv_slots, kv_lora_rank + qk_rope_head_dim], model dtype

    @classmethod
    def allocate(
        cls, cfg: ModelConfig, num_state_slots: int, num_kv_slots: int, device: torch.device | str = "cpu"
    ) -> HybridCache:
        h, d, w = cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size
        dt = cfg.torch_dtype
        return cls(
            recurrent=[torch.zeros(num_state_slots, h, d, d, device=device) for _ in cfg.kda_layers],
            conv=[torch.zeros(num_state_slots, cfg.conv_dim, w - 1, dtype=dt, device=device) for _ in cfg.kda_layers],
            latent=[torch.zeros(num_kv_slots, cfg.kv_dim, dtype=dt, device=device) for _ in cfg.mla_layers],
        )


@dataclass
class ForwardBatch:
    """N sequences, each extending its cached prefix by `cu_seqlens[i+1] - cu_seqlens[i]` new tokens (packed)."""

    input_ids: torch.Tensor  # [T] int64, new tokens of all sequences, packed
    cu_seqlens: torch.Tensor  # [N+1] int64, offsets of each sequence's new tokens
    prefix_lens: torch.Tensor  # [N] int64, tokens already in the cache (KDA state valid iff > 0)
    state_slots: torch.Tensor  # [N] int64, KDA state slot of each sequence (read if prefix > 0, then written)
    kv_slots: torch.Tensor  # [T] int64, KV slot for each new token's latent
    kv_indices: torch.Tensor  # [sum(prefix + new)] int64, each sequence's KV slots in order, concatenated
    kv_indptr: torch.Tensor  # [N+1] int64, offsets into kv_indices
    logits_index: torch.Tensor | None = None  # [M] rows of the packed tokens to compute logits for; None = last

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens.numel() - 1)

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token on top of a non-empty prefix: the in-place decode path."""
        return bool(self.input_ids.numel() == self.num_seqs and (self.prefix_lens > 0).all())

    def last_token_index(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - 1

    @classmethod
    def build(
        cls,
        new_tokens: list[list[int]],
        prefix_lens: list[int],
        state_slots: list[int],
        kv_slot_lists: list[list[int]],
        device: torch.device | str = "cpu",
        all_logits: bool = False,
    ) -> ForwardBatch:
        """From per-sequence lists; `kv_slot_lists[i]` holds all of sequence i's slots (prefix then new)."""
        lens = [len(t) for t in new_tokens]
        for i, slots in enumerate(kv_slot_lists):
            if len(slots) != prefix_lens[i] + lens[i]:
                raise ValueError(f"sequence {i}: {len(slots)} KV slots for {prefix_lens[i]} + {lens[i]} tokens")
        if any(n == 0 for n in lens):
            raise ValueError("every sequence in a batch must add at least one token")

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        indptr = [0]
        for s in kv_slot_lists:
            indptr.append(indptr[-1] + len(s))
        new_slots = [s for slots, p in zip(kv_slot_lists, prefix_lens, strict=True) for s in slots[p:]]
        return cls(
            input_ids=t([x for seq in new_tokens for x in seq]),
            cu_seqlens=t(cu),
            prefix_lens=t(prefix_lens),
            state_slots=t(state_slots),
            kv_slots=t(new_slots),
            kv_indices=t([s for slots in kv_slot_lists for s in slots]),
            kv_indptr=t(indptr),
            logits_index=t(list(range(cu[-1]))) if all_logits else None,
        )
