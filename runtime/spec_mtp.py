"""The MTP proposer (`--speculative-algorithm mtp`): the target's own MTP layers draft."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from kernels.sampling_row import SamplingRow
from radixk3.forward_batch import ForwardBatch, ForwardMode, HybridCache
from radixk3.model import KimiForCausalLM
from runtime.pool_buffer import PoolBuffer
from runtime.spec_drafts import any_sampled, choose, window_layout


class MTPProposer:
    """The target's own MTP layer drafts (`--speculative-algorithm mtp`). Its latent KV at position p holds
    fuse(embed(token p+1), h_p), h_p the target's pre-norm final hidden there, in the pool's MLA-only nested part
    (every token row), so radix hits, copies and retraction carry it. `observe` (after sampling) runs the layer
    over each step's new positions, the last one with the sampled token, and keeps per page-table row its output
    there: the mtp logits of that output are draft 1 of the next verify window [x_L, d1..dk]. Draft j > 1 chains
    one more MTP step at position L+j-2 on (d_{j-1}, the previous step's output); those chained entries are
    rewritten by `after_verify`, which reruns the layer over the committed positions with the verify's target
    hiddens and tokens. Only MTP layer 0 is run (every chained step reuses it): a further layer's KV would need
    tokens two positions ahead at the last committed position. The last position of a prompt chunk that does not
    sample keeps a stale entry (its next token is the next chunk's first): only acceptance can suffer, never
    outputs. Sampled requests draw drafts from the tempered, truncated MTP distribution (as the draft model)."""

    needs_hidden = True
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, model: KimiForCausalLM, buffer: PoolBuffer, num_rows: int) -> None:
        cfg = model.config
        if cfg.num_nextn_predict_layers < 1:
            raise ValueError("--speculative-algorithm mtp: the checkpoint has no MTP layers")
        self.model = model
        self.cache = HybridCache(recurrent=[], conv=[],
                                 latent=[buffer.kv(i, draft=True) for i in range(cfg.num_nextn_predict_layers)])
        # Per page-table row: the MTP output at the last committed position (its logits give draft 1).
        self.last_out = torch.zeros(num_rows, cfg.hidden_size, dtype=model.lm_head.weight.dtype, device=model.device)

    def _run(self, batch: ForwardBatch, hidden: Tensor, next_last: Tensor, rows: Tensor) -> None:
        """MTP layer 0 over `batch`'s new positions: next token = the following new token, or `next_last`."""
        ids = batch.input_ids
        last = batch.last_token_index()
        next_ids = torch.roll(ids, -1)
        next_ids[last] = next_last.clamp(min=0)  # a chunk that did not sample: a stale entry (see class doc)
        sub = dataclasses.replace(batch, input_ids=next_ids, logits_index=None, attn_backend=None, spec=None)
        out = self.model.forward_mtp_batch(0, sub, hidden, self.cache).hidden
        have = next_last >= 0
        self.last_out[rows[have]] = out[last[have]].to(self.last_out.dtype)

    def observe(self, batch: ForwardBatch, hidden: Tensor | None, next_last: Tensor, rows: Tensor) -> None:
        if batch.mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
            assert hidden is not None
            self._run(batch, hidden, next_last, rows)

    def propose(self, batch: ForwardBatch, rows: Tensor, params: list[list[SamplingRow]]) -> Tensor | None:
        ids = batch.input_ids
        _, _, lens = window_layout(batch.cu_seqlens)
        starts = batch.cu_seqlens[:-1]
        width = int(lens.max())
        vocab = self.model.config.vocab_size
        probs = torch.zeros(lens.numel(), width - 1, vocab, device=ids.device) if any_sampled(params) else None
        out = self.last_out[rows]
        for j in range(1, width):
            drafting = (lens > j).nonzero().squeeze(1)
            logits = self.model.mtp_logits(0, out[drafting]).float()
            d, q = choose(logits, None if probs is None else [params[i][j - 1] for i in drafting.tolist()])
            if probs is not None:
                probs[drafting, j - 1] = q
            ids[starts[drafting] + j] = d
            more = lens[drafting] > j + 1
            if not bool(more.any()):
                continue
            # Chain: one MTP step at position L+j-1 on (d_j, previous output) for the windows that draft on.
            on = drafting[more]
            cu = torch.arange(on.numel() + 1, device=ids.device)
            step = ForwardBatch.from_table(ForwardMode.DECODE, d[more], cu, batch.prefix_lens[on] + j - 1,
                                           batch.state_slots[on], batch.block_table[on], batch.page_size)
            new = self.model.forward_mtp_batch(0, step, out[on], self.cache).hidden
            out = out.clone()
            out[on] = new.to(out.dtype)
        return probs

    def commit(self, state_slots: Tensor, rows: Tensor, num_tokens: Tensor, check: bool) -> None:
        pass  # no recurrent state: after_verify rewrites the committed positions' latents

    def after_verify(self, batch: ForwardBatch, hidden: Tensor, num_tokens: Tensor, last: Tensor,
                     rows: Tensor) -> None:
        seq, pos, _ = window_layout(batch.cu_seqlens)
        keep = pos < num_tokens[seq]
        cu = torch.nn.functional.pad(num_tokens.cumsum(0), (1, 0))
        sub = ForwardBatch.from_table(ForwardMode.EXTEND, batch.input_ids[keep], cu, batch.prefix_lens,
                                      batch.state_slots, batch.block_table, batch.page_size)
        self._run(sub, hidden[keep], last, rows)
