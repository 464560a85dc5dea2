"""What one cached forward step needs: the batch layout, its mode, and the page table it addresses the cache by.

The cache tensors (`HybridCache`) are per layer and indexed by *physical* slot: a KDA state slot holds one
sequence's recurrent and conv state for that layer, a KV slot one token's MLA latent. They are standalone
tensors (`HybridCache.allocate`) or strided views into the runtime's unified pool. Model layers never index
them: `KimiForCausalLM.forward_batch` gives the batch an attention backend (`attention_backend.py`) that runs
the pool-resident kernels on them, in place.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.state_checkpoints import StateCheckpoints
from radixk3.config import ModelConfig
from radixk3.parallel import parallel_state

if TYPE_CHECKING:
    from radixk3.attention_backend import AttentionBackend
    from radixk3.spec_window import WindowRows


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill chunks on any prefix (decodes may ride along: a mixed batch)
    DECODE = "decode"  # exactly one new token per sequence, on a non-empty prefix: the fast path
    VERIFY = "verify"  # k+1 draft positions per sequence with logits at each (speculative decoding)
    IDLE = "idle"  # no tokens at all (a data-parallel rank with nothing to run)


@dataclass
class HybridCache:
    recurrent: list[torch.Tensor]  # per KDA layer: [state_slots, H, K, V] fp32
    conv: list[torch.Tensor]  # per KDA layer: [state_slots, 3*H*D, conv_kernel - 1], model dtype
    latent: list[torch.Tensor]  # per MLA layer: [kv_slots, kv_lora_rank + qk_rope_head_dim], model dtype

    @classmethod
    def allocate(
        cls, cfg: ModelConfig, num_state_slots: int, num_kv_slots: int, device: torch.device | str = "cpu"
    ) -> HybridCache:
        tp = parallel_state().attn_tp_size  # this rank's KDA heads (its attention group's share), as its model
        h, d, w = cfg.kda_num_heads // tp, cfg.kda_head_dim, cfg.conv_kernel_size
        dt = cfg.torch_dtype
        return cls(
            recurrent=[torch.zeros(num_state_slots, h, d, d, device=device) for _ in cfg.kda_layers],
            conv=[torch.zeros(num_state_slots, 3 * h * d, w - 1, dtype=dt, device=device) for _ in cfg.kda_layers],
            latent=[torch.zeros(num_kv_slots, cfg.kv_dim, dtype=dt, device=device) for _ in cfg.mla_layers],
        )


@dataclass(frozen=True)
class EmbeddingOverride:
    """Rows that replace some packed tokens' embeddings in the first layer's input: an image's projected
    embeddings at its `<|media_pad|>` positions. `positions` [R] int64 index the packed tokens, `rows` [R, hidden]."""

    positions: torch.Tensor
    rows: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """`x` [T, hidden] (the token embeddings) with the override's rows in place."""
        return x.index_copy(0, self.positions, self.rows.to(x.dtype))


@dataclass
class ForwardBatch:
    """N sequences, each extending its cached prefix by `cu_seqlens[i+1] - cu_seqlens[i]` new tokens (packed).

    Sequence i's KV slot of position p is block_table[i, p // page_size] * page_size + p % page_size; its KDA
    state lives in `state_slots[i]` (read iff prefix_lens[i] > 0, then overwritten). `checkpoints` asks the
    KDA layers for extra states at positions inside this step's new tokens (radix-tree checkpoints)."""

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64, new tokens of all sequences, packed
    cu_seqlens: torch.Tensor  # [N+1] int64, offsets of each sequence's new tokens
    prefix_lens: torch.Tensor  # [N] int64, tokens already in the cache
    state_slots: torch.Tensor  # [N] int64, physical KDA state slot of each sequence
    block_table: torch.Tensor  # [N, max_pages] int64, physical KV page ids of each sequence
    page_size: int
    kv_slots: torch.Tensor  # [T] int64, KV slot of each new token (derived from the table)
    checkpoints: StateCheckpoints | None = None
    logits_index: torch.Tensor | None = None  # [M] rows of the packed tokens to compute logits for; None = last
    attn_backend: AttentionBackend | None = None  # set by the model's forward_batch
    spec: WindowRows | None = None  # verify mode: the draft window the KDA layers fill (spec_window.py)
    embeds: EmbeddingOverride | None = None  # extend mode: image rows in place of their pad tokens' embeddings

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens.numel() - 1)

    @property
    def seq_lens(self) -> torch.Tensor:
        """Cached tokens per sequence after this step: prefix + new."""
        return self.prefix_lens + (self.cu_seqlens[1:] - self.cu_seqlens[:-1])

    def last_token_index(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - 1

    @classmethod
    def from_table(
        cls,
        mode: ForwardMode,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        prefix_lens: torch.Tensor,
        state_slots: torch.Tensor,
        block_table: torch.Tensor,
        page_size: int,
        checkpoints: StateCheckpoints | None = None,
        logits_index: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """A batch over page-table rows (already gathered per sequence); the new tokens' KV slots are derived."""
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        n, t = lens.numel(), input_ids.numel()
        if mode is ForwardMode.DECODE and t != n:
            raise ValueError(f"a decode batch adds one token per sequence: {t} tokens for {n} sequences")
        seq = torch.repeat_interleave(torch.arange(n, device=lens.device), lens, output_size=t)
        pos = torch.arange(t, device=lens.device) - cu_seqlens[:-1][seq] + prefix_lens[seq]
        kv_slots = block_table[seq, pos // page_size] * page_size + pos % page_size
        return cls(mode, input_ids, cu_seqlens, prefix_lens, state_slots, block_table, page_size, kv_slots,
                   checkpoints, logits_index)

    @classmethod
    def build(
        cls,
        new_tokens: list[list[int]],
        prefix_lens: list[int],
        state_slots: list[int],
        kv_slot_lists: list[list[int]],
        device: torch.device | str = "cpu",
        all_logits: bool = False,
        checkpoints: list[tuple[int, int, int]] | None = None,
    ) -> ForwardBatch:
        """From per-sequence lists (tests, the single-sequence loops): `kv_slot_lists[i]` holds all of sequence
        i's slots (prefix then new), i.e. a page table of page size 1; `checkpoints` as (seq, offset, slot)."""
        lens = [len(t) for t in new_tokens]
        for i, slots in enumerate(kv_slot_lists):
            if len(slots) != prefix_lens[i] + lens[i]:
                raise ValueError(f"sequence {i}: {len(slots)} KV slots for {prefix_lens[i]} + {lens[i]} tokens")
        if any(n == 0 for n in lens):
            raise ValueError("every sequence in a batch must add at least one token")

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        width = max(len(s) for s in kv_slot_lists)
        table = t([s + [0] * (width - len(s)) for s in kv_slot_lists] if width else []).view(len(lens), width)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        decode = all(n == 1 for n in lens) and all(p > 0 for p in prefix_lens)
        ck = None
        if checkpoints:
            ck = StateCheckpoints(*(t([c[i] for c in checkpoints]) for i in range(3)))
        return cls.from_table(
            ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            t([x for seq in new_tokens for x in seq]), t(cu), t(prefix_lens), t(state_slots), table, 1, ck,
            t(list(range(cu[-1]))) if all_logits else None,
        )
