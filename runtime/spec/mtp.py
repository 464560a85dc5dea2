"""The MTP proposer (`--speculative-algorithm mtp`): the target's own MTP layers draft, chained as vLLM's
`KimiK3MTP` runs them (draft j + 1 from layer j % n, n = `num_nextn_predict_layers`, each step's output the next
step's h).

Each layer m keeps its latent KV in the pool's MLA-only nested part (every token row), so radix hits, copies and
retraction carry it. At a committed position p (the target ran it, its next token x_{p+1} is known), layer m's
entry is the chain's: layer 0 on (x_{p+1}, h_p), h_p the target's pre-norm final hidden; layer m > 0 on
(x_{p+1}, layer m-1's output at p-1) (the target's h_0 at position 0, or when p-1 was never run here, as after a
radix hit). `observe` (after sampling) runs every layer over each step's new positions, the last one with the
sampled token, and keeps per page-table row each layer's output at the last committed position L-1: layer 0's
logits there give draft 1 of the next verify window [x_L, d_1..d_k]. Draft j + 1 runs layer m = j % n at
position L-1+j on (d_j, the previous step's output); first it catches layer m's KV up over the chain positions
it has not written this round (inputs: the drafts and the chain's outputs), so no layer ever attends over a slot
it did not write for this window. `after_verify` reruns every layer over the committed positions with the
verify's target hiddens and tokens, overwriting the chain's entries. The last position of a prompt chunk that
does not sample waits (its next token is the next chunk's first): the next chunk's run starts there. Sampled
requests draw drafts from the tempered, truncated MTP distribution (as the draft model).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from kernels.sampling_tensors import SamplingTensors
from radixk3.forward_batch import ForwardBatch, ForwardMode, HybridCache
from radixk3.model import KimiForCausalLM
from radixk3.mtp import MTPOutput
from radixk3.mtp_graph import MTPGraphs
from runtime.spec.drafts import choose, draft_windows, window_layout
from runtime.worker.pool_buffer import PoolBuffer


class MTPProposer:
    needs_hidden = True
    aux_layer_ids: tuple[int, ...] = ()
    observes_verify = True  # after_verify runs every layer, as observe does

    def __init__(self, model: KimiForCausalLM, buffer: PoolBuffer, num_rows: int) -> None:
        cfg = model.config
        if cfg.num_nextn_predict_layers < 1:
            raise ValueError("--speculative-algorithm mtp: the checkpoint has no MTP layers")
        self.model = model
        self.num_layers = cfg.num_nextn_predict_layers
        self.cache = HybridCache(recurrent=[], conv=[],
                                 latent=[buffer.kv(i, draft=True) for i in range(self.num_layers)])
        dtype, dev = model.lm_head.weight.dtype, model.device
        # Per layer and page-table row: the layer's output at the row's last committed position `last_pos`.
        self.last_out = torch.zeros(self.num_layers, num_rows, cfg.hidden_size, dtype=dtype, device=dev)
        self.last_pos = torch.full((num_rows,), -1, dtype=torch.int64, device=dev)
        # A non-final prompt chunk's last position waits for the next chunk's first token: its position and
        # target hidden per row (-1: none pending).
        self.pending_pos = torch.full((num_rows,), -1, dtype=torch.int64, device=dev)
        self.pending_h = torch.zeros(num_rows, cfg.hidden_size, dtype=dtype, device=dev)
        # The captured draft and catch-up steps (the worker's, when compiled; one MTP layer only).
        self.graphs: MTPGraphs | None = None

    def _defer(self, batch: ForwardBatch, hidden: Tensor, next_last: Tensor, rows: Tensor
               ) -> tuple[ForwardBatch, Tensor, Tensor]:
        """`batch` as MTP positions (input ids: the token after each position, or `next_last`), less the last
        position of a chunk that did not sample (its next token is the next chunk's first: kept pending with its
        target hidden) and plus the row's pending position before a chunk that follows one. Returns the batch,
        its hiddens and its sequences' rows (a sequence left with no position is dropped)."""
        ids, cu = batch.input_ids, batch.cu_seqlens
        n = batch.num_seqs
        next_ids = torch.roll(ids, -1)
        next_ids[cu[1:] - 1] = next_last.clamp(min=0)
        pend = (self.pending_pos[rows] == batch.prefix_lens - 1) & (batch.prefix_lens > 0)
        hold = next_last < 0
        if not bool(pend.any() or hold.any()):
            self.pending_pos[rows] = -1
            return dataclasses.replace(batch, input_ids=next_ids, logits_index=None, attn_backend=None,
                                       spec=None), hidden, rows
        seq, off, lens = window_layout(cu)
        keep = torch.ones_like(ids, dtype=torch.bool)
        keep[(cu[1:] - 1)[hold]] = False
        p = pend.nonzero().squeeze(1)
        all_seq = torch.cat([seq[keep], p])
        all_off = torch.cat([off[keep] + 1, torch.zeros_like(p)])  # the pending position goes first
        all_next = torch.cat([next_ids[keep], ids[cu[:-1][p]]])
        all_hidden = torch.cat([hidden[keep], self.pending_h[rows[p]].to(hidden.dtype)])
        order = torch.argsort(all_seq * (int(lens.max()) + 2) + all_off)
        new_lens = torch.bincount(all_seq, minlength=n)
        sel = (new_lens > 0).nonzero().squeeze(1)
        new_cu = torch.nn.functional.pad(new_lens[sel].cumsum(0), (1, 0))
        # The held positions wait for the next chunk's first token; the pending ones are consumed.
        self.pending_pos[rows] = torch.where(hold, batch.seq_lens - 1, -1)
        self.pending_h[rows[hold]] = hidden[(cu[1:] - 1)[hold]].to(self.pending_h.dtype)
        prefix = (batch.prefix_lens - pend.long())[sel]
        out = ForwardBatch.from_table(ForwardMode.EXTEND, all_next[order], new_cu, prefix, batch.state_slots[sel],
                                      batch.block_table[sel], batch.page_size)
        return out, all_hidden[order], rows[sel]

    def _run(self, batch: ForwardBatch, hidden: Tensor, next_last: Tensor, rows: Tensor) -> None:
        """Every MTP layer over `batch`'s new positions whose next token is known (`_defer`)."""
        sub, hidden, rows = self._defer(batch, hidden, next_last, rows)
        if not rows.numel():
            self.idle_observe()
            return
        first, last = sub.cu_seqlens[:-1], sub.last_token_index()
        # The previous position's layer m-1 output is known here iff this row's last run ended just before.
        carried = (self.last_pos[rows] == sub.prefix_lens - 1) & (sub.prefix_lens > 0)
        before = self.last_out[:, rows]  # a copy (advanced indexing): the loop overwrites last_out
        h = hidden
        for m in range(self.num_layers):
            if m > 0:  # layer m reads layer m-1's output one position back
                shifted = torch.roll(h, 1, dims=0)
                shifted[first] = torch.where(carried[:, None], before[m - 1].to(h.dtype),
                                             hidden[first].to(h.dtype))
                h = shifted
            h = self.model.forward_mtp_batch(m, sub, h, self.cache).hidden
            self.last_out[m, rows] = h[last].to(self.last_out.dtype)
        self.last_pos[rows] = sub.seq_lens - 1

    # DP attention: every rank runs the same MTP layers in the same order in a step (their MoE is shared), so a
    # rank with fewer positions joins the others' calls on zero rows. Per step: the draft chain's calls before the
    # target's forward (layer j % n for j = 1 .. `draft_calls` of the widest window), then each layer once after it.
    def draft_calls(self, width: int) -> int:
        """The chain's layer calls for windows up to `width` positions wide: drafts 2 .. width - 1 each run one."""
        return max(width - 2, 0)

    def idle_drafts(self, first: int, last: int) -> None:
        """Join draft-chain calls `first` .. `last` (1-based) that this rank does not make itself."""
        if self.model.dp_attention:
            for j in range(first, last + 1):
                self.model.idle_step(j % self.num_layers)

    def idle_observe(self) -> None:
        """Join the after-forward run of every layer (this rank has no position for it)."""
        if self.model.dp_attention:
            for m in range(self.num_layers):
                self.model.idle_step(m)

    def observe(self, batch: ForwardBatch, hidden: Tensor | None, next_last: Tensor, rows: Tensor) -> None:
        if batch.mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
            assert hidden is not None
            self._run(batch, hidden, next_last, rows)

    def propose(self, batch: ForwardBatch, rows: Tensor, params: SamplingTensors) -> Tensor | None:
        if self.graphs is not None and bool(params.greedy.all()) and self._greedy_chain(batch, rows):
            return None
        ids = batch.input_ids
        starts, lens, width, probs = draft_windows(batch.cu_seqlens, params, self.model.config.vocab_size)
        # chain[:, s]: the chain's output at position L-1+s (s = 0: layer 0's at the last committed position).
        chain = self.last_out.new_zeros(lens.numel(), width, self.last_out.shape[-1])
        chain[:, 0] = self.last_out[0, rows]
        written = [0] * self.num_layers  # per layer: the last chain step whose position it has written
        # The drafting windows' logits for draft j (those of window rows lens > j, in order).
        logits = self.model.mtp_logits(0, chain[lens > 1, 0]).float()
        for j in range(1, width):
            drafting = (lens > j).nonzero().squeeze(1)
            d, q = choose(logits, None if probs is None else params.take(starts[drafting] + j - 1))
            ids[starts[drafting] + j] = d
            if probs is not None:
                probs[drafting, j - 1] = q
            on = drafting[lens[drafting] > j + 1]
            if not on.numel():
                break  # every later draft's window is narrower
            # Step j: layer m at position L-1+j on (d_j, chain[j-1]), after catching its KV up over the steps
            # since it last wrote (inputs: the token after each position and the chain one position back).
            m = j % self.num_layers
            out = None
            if self.graphs is not None:  # one MTP layer: no catching up, one position per window
                out = self.graphs.draft(ids[starts[on] + j], chain[on, j - 1], batch.prefix_lens[on] + j - 1,
                                        batch.block_table[on], batch.page_size)
            if out is None:
                steps = torch.arange(written[m] + 1, j + 1, device=ids.device)
                c = steps.numel()
                tok = ids[(starts[on][:, None] + steps).reshape(-1)]
                hid = chain[on][:, steps - 1].reshape(-1, chain.shape[-1])
                cu = torch.arange(0, (on.numel() + 1) * c, c, device=ids.device)
                mode = ForwardMode.DECODE if c == 1 else ForwardMode.EXTEND
                step = ForwardBatch.from_table(mode, tok, cu, batch.prefix_lens[on] + written[m],
                                               batch.state_slots[on], batch.block_table[on], batch.page_size)
                full = self.model.forward_mtp_batch(m, step, hid, self.cache)
                out = MTPOutput(full.hidden[cu[1:] - 1], full.logits)
            chain[on, j] = out.hidden.to(chain.dtype)
            logits = out.logits.float()  # draft j + 1's, from layer m at this step
            written[m] = j
        return probs

    def _greedy_chain(self, batch: ForwardBatch, rows: Tensor) -> bool:
        """`propose` for windows that are all greedy, through the captured chain step: every draft of every window
        in one call (`MTPGraphs.chain`), where the step-by-step path makes one call per draft and picks each
        draft on the host. False where no bucket fits (the caller drafts step by step)."""
        assert self.graphs is not None
        cu = batch.cu_seqlens
        lens = cu[1:] - cu[:-1]
        if int(lens.max()) < 2:
            return True  # no window drafts
        drafts = self.graphs.chain(self.last_out[0, rows], lens, batch.prefix_lens, batch.block_table,
                                   batch.page_size)
        if drafts is None:
            return False
        n, w = drafts.shape[0], drafts.shape[1] + 1
        if batch.input_ids.numel() == n * w:  # every window full (batch 1): packed is padded
            batch.input_ids.view(n, w)[:, 1:] = drafts
            return True
        seq, pos, _ = window_layout(cu)
        placed = pos > 0  # window position j > 0 holds draft j
        batch.input_ids[placed] = drafts[seq[placed], pos[placed] - 1]
        return True

    def commit(self, state_slots: Tensor, rows: Tensor, num_tokens: Tensor, check: bool) -> None:
        pass  # no recurrent state: after_verify rewrites the committed positions' latents

    def after_verify(self, batch: ForwardBatch, hidden: Tensor, num_tokens: Tensor, last: Tensor,
                     rows: Tensor) -> None:
        if self.graphs is not None and self._catch_up(batch, hidden, num_tokens, last, rows):
            return
        seq, pos, _ = window_layout(batch.cu_seqlens)
        keep = pos < num_tokens[seq]
        cu = torch.nn.functional.pad(num_tokens.cumsum(0), (1, 0))
        sub = ForwardBatch.from_table(ForwardMode.EXTEND, batch.input_ids[keep], cu, batch.prefix_lens,
                                      batch.state_slots, batch.block_table, batch.page_size)
        self._run(sub, hidden[keep], last, rows)

    def _catch_up(self, batch: ForwardBatch, hidden: Tensor, num_tokens: Tensor, last: Tensor, rows: Tensor) -> bool:
        """`after_verify` through the captured catch-up step (one MTP layer, no pending chunk position): the
        windows padded to [n, W]; False where the graphs do not cover the step (the caller runs it eagerly)."""
        assert self.graphs is not None
        n, w = batch.num_seqs, self.graphs.width
        if self.graphs.bucket(n) is None or bool((self.pending_pos[rows] >= 0).any()):
            return False
        # The token after window position j: window token j + 1, or (at the last committed one) `last`.
        if batch.input_ids.numel() == n * w:  # every window full: packed is padded
            ids = batch.input_ids.view(n, w)
            next_ids = torch.cat([ids[:, 1:], ids.new_zeros(n, 1)], 1)
            padded = hidden.reshape(n, w, -1)
        else:
            seq, pos, _ = window_layout(batch.cu_seqlens)
            next_ids = torch.zeros(n, w, dtype=torch.int64, device=last.device)
            inner = pos > 0
            next_ids[seq[inner], pos[inner] - 1] = batch.input_ids[inner]
            padded = hidden.new_zeros(n, w, hidden.shape[-1])
            padded[seq, pos] = hidden
        next_ids[torch.arange(n, device=last.device), num_tokens - 1] = last
        out = self.graphs.catch_up(next_ids, padded, batch.prefix_lens, num_tokens, batch.block_table,
                                   batch.page_size)
        if out is None:
            return False
        self.last_out[0, rows] = out[torch.arange(n, device=out.device), num_tokens - 1].to(self.last_out.dtype)
        self.last_pos[rows] = batch.prefix_lens + num_tokens - 1
        return True
