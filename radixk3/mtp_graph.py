"""The captured steps of the MTP proposer (`runtime/spec/mtp.py`) for a model with one MTP layer: the layer over
padded rows, compiled once per row bucket and replayed, as the decode step is (`decode_graph.py`). (With more MTP
layers the chain's steps catch layers up over several positions: the proposer runs them eagerly.)

- Draft step: one step of the draft chain for B windows (those still drafting, padded to a bucket): the layer on
  (d_j, the chain's previous output) at position L-1+j, its latent stored at that position's KV slot; returns
  the layer's outputs and their logits (the next drafts').
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

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from radixk3.decode_graph import CapturedSteps, PaddedDecode, PaddedDecodeBackend, pad_rows, row_table
from radixk3.forward_batch import ForwardBatch, ForwardMode, HybridCache
from radixk3.model import KimiForCausalLM
from radixk3.mtp import MTPOutput, run_mtp_layer


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


class MTPGraphs(CapturedSteps):
    """The compiled MTP steps of a model with one MTP layer over its MTP cache: draft steps per bucket, catch-up
    steps per bucket of windows `width` tokens wide."""

    kind = "mtp"

    def __init__(self, model: KimiForCausalLM, cache: HybridCache, scratch_kv_row: int, buckets: Sequence[int],
                 width: int, cpp_wrapper: bool = False) -> None:
        if model.config.num_nextn_predict_layers != 1:
            raise ValueError("the compiled MTP steps cover a model with one MTP layer")
        super().__init__(model, cache, buckets, 4, cpp_wrapper)  # one code object: both kinds share it
        self.scratch_kv_row, self.width = scratch_kv_row, width
        self._draft = self._compiled(True)
        self._catch_up = self._compiled(False)

    def _compiled(self, with_logits: bool) -> Callable[[PaddedMTP], MTPOutput]:
        # The flag is a closure constant (guarded by value), never a graph input.
        def step(rows: PaddedMTP) -> MTPOutput:
            return padded_mtp_step(self.model, self.key, 0, rows, with_logits, self.cpp_ops)

        return self.compiled(step)

    def _run_scratch(self, b: int) -> None:
        """Both kinds: rows that touch only the scratch KV row."""
        self._call(self._draft, self._scratch_rows(b))
        self._call(self._catch_up, self._scratch_rows(b * self.width))

    def _scratch_rows(self, r: int) -> PaddedMTP:
        dev, row = self.device, self.scratch_kv_row
        ids = torch.zeros(r, dtype=torch.int64, device=dev)
        hidden = torch.zeros(r, self.model.config.hidden_size, dtype=self.model.lm_head.weight.dtype, device=dev)
        return PaddedMTP(ids, hidden, ids + row, torch.full((r, self.kv_width(2)), row, dtype=torch.int64,
                                                            device=dev), ids + 2)

    def _call(self, fn: Callable[[PaddedMTP], MTPOutput], rows: PaddedMTP) -> MTPOutput:
        return self.replay(fn, rows, rows.next_ids, rows.kv_rows)

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
