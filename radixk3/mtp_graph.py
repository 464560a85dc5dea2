"""The captured steps of the MTP proposer (`runtime/spec/mtp.py`) for a model with one MTP layer: the layer over
padded rows, compiled once per row bucket and replayed, as the decode step is (`decode_graph.py`). (With more MTP
layers the chain's steps catch layers up over several positions: the proposer runs them eagerly.)

- Draft step: one step of the draft chain for B windows (those still drafting, padded to a bucket): the layer on
  (d_j, the chain's previous output) at position L-1+j, its latent stored at that position's KV slot; returns
  the layer's outputs and their logits (the next drafts').
- Draft chain (greedy windows): every draft of B windows in one step: draft 1 from the layer's output at each
  window's last committed position, then the k - 1 chain steps, each draft the argmax of the previous step's
  logits, as the proposer's draft steps and `choose` make them one call at a time.
- Catch-up: after a verify step, the layer over every position of B windows of W tokens (B*W rows, as the verify
  graph packs them) with the target's hiddens there; a position past its window's committed tokens stores its
  latent in the scratch KV row, and its output is dropped.
Each row is one query over its own cached rows (`mla_decode_padded`, decode's absorbed form, through the decode
graph's pool op). Positions enter an MTP layer only through its input fusion (position 0's embedding is zeroed):
a row's position is its KV length - 1, so a padding row (length 1) sits at 0, a real one never does.
The eager MTP layer stays the oracle: `tests/radixk3/test_mtp_graph.py` checks both steps' outputs and stored
latents against it (padded rows, windows of several lengths), and `tests/runtime/test_verify_graph.py` greedy tokens
and accepted drafts with MTP speculation, compiled against eager.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from radixk3.decode_graph import CapturedSteps, PaddedDecode, PaddedDecodeBackend, pad_rows, row_table
from radixk3.forward_batch import ForwardBatch, ForwardMode, HybridCache
from radixk3.model import KimiForCausalLM
from radixk3.mtp import MTPOutput, run_mtp_layer
from radixk3.step_graph import StepGraph


class PaddedMTP(NamedTuple):
    """One bucket's rows (padding included): each an MTP position, one query."""

    next_ids: Tensor  # [R] int64, the token after each row's position
    hidden: Tensor  # [R, H], the hidden there (the target's, or the chain's previous output)
    kv_slots: Tensor  # [R] int64, where each row's latent is stored
    kv_rows: Tensor  # [R, S] int64, each row's cached KV rows (its own last), padded with any valid row
    kv_lens: Tensor  # [R] int64, valid entries of kv_rows per row (the row's position + 1)


def padded_mtp_step(model: KimiForCausalLM, cache_key: int, index: int, step: PaddedMTP,
                    with_logits: bool, cpp_ops: bool = False) -> MTPOutput:
    """MTP layer `index` over `step`'s rows on cache `cache_key` -> its pre-norm outputs [R, H] and (with_logits)
    their fp32 logits [R, V] (else an empty [0, V])."""
    r = step.next_ids.shape[0]
    cu = torch.arange(r + 1, device=step.next_ids.device)
    rows = PaddedDecode(step.next_ids, step.kv_slots, step.kv_slots, step.kv_rows, step.kv_lens)
    batch = ForwardBatch(ForwardMode.DECODE, step.next_ids, cu, step.kv_lens - 1, rows.state_slots, step.kv_rows, 1,
                         step.kv_slots, attn_backend=PaddedDecodeBackend(cache_key, rows, cpp_ops))  # type: ignore[arg-type]
    out = run_mtp_layer(model.model.mtp_layers, index, step.next_ids, step.hidden, cu, batch,
                        positions=step.kv_lens - 1)
    logits = model.mtp_logits(index, out if with_logits else out[:0]).float()
    return MTPOutput(out, logits)


class PaddedChain(NamedTuple):
    """One bucket's windows (padding included) for the greedy draft chain of C = k - 1 steps."""

    hidden: Tensor  # [B, H] the layer's output at each window's last committed position L - 1
    kv_slots: Tensor  # [B, C] where chain step j + 1 (position L + j) stores its latent (past the window: scratch)
    kv_rows: Tensor  # [B, S] each window's cached KV rows through its last chain position
    kv_lens: Tensor  # [B, C] KV length at chain step j + 1: its position + 1


def padded_mtp_chain(model: KimiForCausalLM, cache_key: int, chain: PaddedChain, cpp_ops: bool = False) -> Tensor:
    """The greedy drafts [B, C + 1] of `chain`'s windows: draft 1 from the logits of `chain.hidden`, draft j + 1
    from chain step j, MTP layer 0 at position L + j - 1 on (draft j, the previous output)."""
    hidden = chain.hidden
    draft = model.mtp_logits(0, hidden).float().argmax(-1)
    drafts = [draft]
    for j in range(chain.kv_slots.shape[1]):
        step = PaddedMTP(draft, hidden, chain.kv_slots[:, j], chain.kv_rows, chain.kv_lens[:, j])
        out = padded_mtp_step(model, cache_key, 0, step, True, cpp_ops)
        hidden, draft = out.hidden.to(hidden.dtype), out.logits.argmax(-1)
        drafts.append(draft)
    return torch.stack(drafts, 1)


class MTPGraphs(CapturedSteps):
    """The compiled MTP steps of a model with one MTP layer over its MTP cache: draft steps, greedy draft chains
    and catch-up steps per bucket of windows `width` tokens wide."""

    kind = "mtp"

    def __init__(self, model: KimiForCausalLM, cache: HybridCache, scratch_kv_row: int, buckets: Sequence[int],
                 width: int, cpp_wrapper: bool = False) -> None:
        if model.config.num_nextn_predict_layers != 1:
            raise ValueError("the compiled MTP steps cover a model with one MTP layer")
        # one code object for the draft and catch-up steps, one for the chain (a static and a dynamic entry each)
        super().__init__(model, cache, buckets, 6, cpp_wrapper)
        self.scratch_kv_row, self.width = scratch_kv_row, width
        self._draft = self._compiled(True)
        self._catch_up = self._compiled(False)
        self._chain = self.compiled(self._chain_step)
        self.chains = 0  # greedy draft chains served (of `replays`)

    def _chain_step(self, chain: PaddedChain) -> Tensor:
        return padded_mtp_chain(self.model, self.key, chain, self.cpp_ops)

    def _compiled(self, with_logits: bool) -> StepGraph:
        # The flag is a closure constant (guarded by value), never a graph input.
        def step(rows: PaddedMTP) -> MTPOutput:
            return padded_mtp_step(self.model, self.key, 0, rows, with_logits, self.cpp_ops)

        return self.compiled(step)

    def _run_scratch(self, b: int) -> None:
        """Every kind: rows that touch only the scratch KV row."""
        self._call(self._draft, self._scratch_rows(b))
        self._call(self._catch_up, self._scratch_rows(b * self.width))
        rows = self._scratch_rows(b)
        steps = self.width - 2
        self._call_chain(PaddedChain(rows.hidden, rows.kv_slots[:, None].expand(b, steps).contiguous(), rows.kv_rows,
                                     rows.kv_lens[:, None].expand(b, steps).contiguous()))

    def _scratch_rows(self, r: int) -> PaddedMTP:
        dev, row = self.device, self.scratch_kv_row
        ids = torch.zeros(r, dtype=torch.int64, device=dev)
        hidden = torch.zeros(r, self.model.config.hidden_size, dtype=self.model.lm_head.weight.dtype, device=dev)
        return PaddedMTP(ids, hidden, ids + row, torch.full((r, self.kv_width(2)), row, dtype=torch.int64,
                                                            device=dev), ids + 2)

    def _call(self, fn: StepGraph, rows: PaddedMTP) -> MTPOutput:
        return self.replay(fn, rows, rows.next_ids, rows.kv_rows)

    def _call_chain(self, chain: PaddedChain) -> Tensor:
        return self.replay(self._chain, chain, chain.hidden, chain.kv_rows)

    def _kv(self, block_table: Tensor, page_size: int, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """KV slot, row table [R, S] and length of rows at `positions` [R] of sequences `block_table` [R, P]."""
        lens = positions + 1
        rows = row_table(block_table, page_size, lens, self.kv_width(int(lens.max())))
        return rows.gather(1, positions[:, None]).squeeze(1), rows, lens

    def draft(self, next_ids: Tensor, hidden: Tensor, positions: Tensor, block_table: Tensor,
              page_size: int) -> MTPOutput | None:
        """One chain step for n windows: (next_ids [n], hidden [n, H]) at `positions` [n] of
        sequences with pages `block_table` [n, P] -> outputs [n, H] and logits [n, V]; None if no bucket fits."""
        n = next_ids.shape[0]
        b = self.bucket(n)
        if b is None:
            return None
        slots, rows, lens = self._kv(block_table, page_size, positions)
        kv = self.scratch_kv_row
        step = PaddedMTP(pad_rows(next_ids, b, 0), pad_rows(hidden, b, 0), pad_rows(slots, b, kv),
                         pad_rows(rows, b, kv), pad_rows(lens, b, 1))
        self.replays += 1
        out = self._call(self._draft, step)
        return MTPOutput(out.hidden[:n], out.logits[:n])

    def chain(self, hidden: Tensor, lens: Tensor, prefix_lens: Tensor, block_table: Tensor,
              page_size: int) -> Tensor | None:
        """Every greedy draft of n windows of `lens` [n] tokens (the last committed token, then its drafts) at
        positions `prefix_lens` [n] on, with pages `block_table` [n, P]: `hidden` [n, H] is the layer's output at
        each window's last committed position -> drafts [n, width - 1], of which window i keeps lens[i] - 1; None
        if no bucket fits. A window narrower than `width` runs every chain step, those past its drafts on the
        scratch KV row (their drafts are dropped)."""
        n = hidden.shape[0]
        b = self.bucket(n)
        if b is None:
            return None
        steps = torch.arange(1, self.width - 1, device=self.device)[None, :]  # chain step j at position L + j - 1
        # The row table through each window's last position but one (its pages exist), the rest repeating it.
        table_lens = prefix_lens + lens - 1
        rows = row_table(block_table, page_size, table_lens, self.kv_width(int(table_lens.max())))
        used = steps <= lens[:, None] - 2
        kv_lens = torch.where(used, prefix_lens[:, None] + steps, prefix_lens[:, None])
        slots = torch.where(used, rows.gather(1, (kv_lens - 1).clamp(min=0)), self.scratch_kv_row)
        kv = self.scratch_kv_row
        chain = PaddedChain(pad_rows(hidden, b, 0), pad_rows(slots, b, kv), pad_rows(rows, b, kv),
                            pad_rows(kv_lens, b, 1))
        self.replays += 1
        self.chains += 1
        return self._call_chain(chain)[:n]

    def catch_up(self, next_ids: Tensor, hidden: Tensor, prefix_lens: Tensor, num_tokens: Tensor,
                 block_table: Tensor, page_size: int) -> Tensor | None:
        """The layer over n windows' committed positions: `next_ids` and `hidden` [n, W(, H)] per window position
        (past num_tokens[i]: anything), the window of sequence i at positions prefix_lens[i] + j -> the outputs
        [n, W, H] (past num_tokens[i]: dropped by the caller); None if no bucket fits."""
        n, w = next_ids.shape
        b = self.bucket(n)
        if b is None:
            return None
        offsets = torch.arange(w, device=self.device)[None, :]
        # Past its committed tokens a window's rows repeat its last committed position (whose pages exist).
        positions = (prefix_lens[:, None] + torch.minimum(offsets, num_tokens[:, None] - 1)).reshape(-1)
        slots, rows, lens = self._kv(block_table.repeat_interleave(w, 0), page_size, positions)
        kv = self.scratch_kv_row
        committed = (offsets < num_tokens[:, None]).reshape(-1)
        slots = torch.where(committed, slots, kv)  # the rest of the window: never written (its slots may be free)
        r = b * w
        step = PaddedMTP(pad_rows(next_ids.reshape(-1), r, 0), pad_rows(hidden.reshape(n * w, -1), r, 0),
                         pad_rows(slots, r, kv), pad_rows(rows, r, kv), pad_rows(lens, r, 1))
        self.replays += 1
        return self._call(self._catch_up, step).hidden[: n * w].view(n, w, -1)
