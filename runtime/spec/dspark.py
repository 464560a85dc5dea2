"""The DSpark proposer (`--speculative-algorithm dspark --speculative-draft-model <k3_dspark checkpoint>`): K3's
parallel drafter (`radixk3/dspark.py`) drafts a whole window in one block-non-causal pass.

Context: the drafter's per-layer context latents of every position the target has run, computed from the
target's aux states (its states after `target_layer_ids`, which the worker asks `forward_batch` for when
`aux_layer_ids` is set) and kept in the pool's MLA-only nested part (`PoolLayout.draft`, one latent per draft
layer in every token row), so that radix hits, copies and retraction carry them like the target's KV. `observe`
stores them for each extend and decode step's new tokens; `after_verify` for a verify window's committed
positions (the target's states at them come from the verify forward).

Drafting, at the start of verify: a window [x_L, d_1..d_k] has context positions [0, L) and anchor x_L. The block
(anchor + B-1 noise tokens at L..L+B-1) runs once; its own latents go to the window's KV slots, where the
committed positions' context latents overwrite them after verify (the rejected ones are freed or rewritten
later). Block position i predicts L+1+i, so B >= k; B is the drafter's trained `block_size` when the window
(k+1 positions) holds it, else k (`block_length`). The Markov head then chooses d_1..d_k in order
(prev = anchor): greedy rows take the argmax, sampled rows draw from the tempered, truncated q, which goes to
rejection sampling (as the other proposers).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.sampling_tensors import SamplingTensors
from radixk3.dspark import DSparkModel, store_context
from radixk3.dspark_checkpoint import load_dspark
from radixk3.forward_batch import ForwardBatch, ForwardMode, HybridCache
from radixk3.model import KimiForCausalLM
from radixk3.mtp import token_positions
from runtime.spec.drafts import choose, draft_windows, window_layout
from runtime.worker.pool_buffer import PoolBuffer, torch_dtype


def block_length(num_drafts: Tensor, block_size: int) -> Tensor:
    """Block tokens that draft `num_drafts` tokens inside a window of num_drafts + 1 positions: the trained
    block size when it fits, never fewer than the drafts."""
    return torch.maximum(num_drafts, num_drafts.add(1).clamp(max=block_size))


class DSparkProposer:
    needs_hidden = True

    def __init__(self, drafter: DSparkModel, buffer: PoolBuffer) -> None:
        self.drafter = drafter
        cfg = drafter.config
        self.aux_layer_ids = cfg.target_layer_ids  # the worker hands their states, concatenated, as `hidden`
        self.cache = HybridCache(recurrent=[], conv=[],
                                 latent=[buffer.kv(i, draft=True) for i in range(cfg.num_hidden_layers)])

    def _store(self, aux: Tensor, positions: Tensor, slots: Tensor) -> None:
        store_context(self.cache, self.drafter.context_latents(aux, positions), slots)

    def observe(self, batch: ForwardBatch, hidden: Tensor | None, next_last: Tensor, rows: Tensor) -> None:
        if batch.mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
            assert hidden is not None
            self._store(hidden, token_positions(batch.cu_seqlens, batch.prefix_lens), batch.kv_slots)

    def propose(self, batch: ForwardBatch, rows: Tensor, params: SamplingTensors) -> Tensor | None:
        ids = batch.input_ids
        starts, lens, _, probs = draft_windows(batch.cu_seqlens, params, self.drafter.config.vocab_size)
        k = lens - 1
        blocks = block_length(k, self.drafter.config.block_size)
        for b in torch.unique(blocks[k > 0]).tolist():  # one pass per block length (nearly always one)
            group = ((blocks == b) & (k > 0)).nonzero().squeeze(1)
            anchors = ids[starts[group]]
            base = self.drafter.draft_block_paged(anchors, self.cache, batch.block_table[group],
                                                  batch.prefix_lens[group], batch.page_size, block=b).logits
            prev, kg = anchors, k[group]
            for i in range(int(kg.max())):
                on = (kg > i).nonzero().squeeze(1)
                logits = self.drafter.markov_logits(base[on, i], prev[on])
                d, q = choose(logits, None if probs is None else params.take(starts[group[on]] + i))
                ids[starts[group[on]] + 1 + i] = d
                if probs is not None:
                    probs[group[on], i] = q
                prev = prev.clone()
                prev[on] = d
        return probs

    def commit(self, state_slots: Tensor, rows: Tensor, num_tokens: Tensor, check: bool) -> None:
        pass  # no recurrent state: after_verify writes the committed positions' context latents

    def after_verify(self, batch: ForwardBatch, hidden: Tensor, num_tokens: Tensor, last: Tensor,
                     rows: Tensor) -> None:
        seq, pos, _ = window_layout(batch.cu_seqlens)
        keep = pos < num_tokens[seq]
        self._store(hidden[keep], (pos + batch.prefix_lens[seq])[keep], batch.kv_slots[keep])


def load_dspark_proposer(path: str, target: KimiForCausalLM, buffer: PoolBuffer) -> DSparkProposer:
    """The drafter at `path`, in the pool's model dtype (its latents share the target's token rows)."""
    drafter = load_dspark(path, target)
    dtype = torch_dtype(buffer.layout.kv_dtype)
    if dtype != drafter.config.torch_dtype:
        drafter = drafter.to(dtype)
    return DSparkProposer(drafter.eval(), buffer)
