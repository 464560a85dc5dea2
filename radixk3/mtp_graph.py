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

import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from radixk3.decode_graph import (
    _CACHES,
    _NEXT_KEY,
    CaptureReport,
    PaddedDecode,
    PaddedDecodeBackend,
    compile_options,
)
from radixk3.forward_batch import ForwardBatch, ForwardMode, HybridCache
from radixk3.model import KimiForCausalLM
from radixk3.mtp import MTPOutput, run_mtp_layer

log = logging.getLogger(__name__)


class PaddedMTP(NamedTuple):
    """One bucket's rows (padding included): each an MTP position, one query."""

    next_ids: Tensor  # [R] int64, the token after each row's position
    hidden: Tensor  # [R, H], the hidden there (the target's, or the chain's previous output)
    kv_slots: Tensor  # [R] int64, where each row's latent is stored
    kv_rows: Tensor  # [R, S] int64, each row's cached KV rows (its own last), padded with any valid row
    kv_lens: Tensor  # [R] int64, valid entries of kv_rows per row (the row's position + 1)


def padded_mtp_step(model: KimiForCausalLM, cache_key: int, index: int, step: PaddedMTP,
                    with_logits: bool) -> MTPOutput:
    """MTP layer `index` over `step`'s rows on cache `cache_key` -> its pre-norm outputs [R, H] and (with_logits)
    their fp32 logits [R, V] (else an empty [0, V])."""
    r = step.next_ids.shape[0]
    cu = torch.arange(r + 1, device=step.next_ids.device)
    rows = PaddedDecode(step.next_ids, step.kv_slots, step.kv_slots, step.kv_rows, step.kv_lens)
    batch = ForwardBatch(ForwardMode.DECODE, step.next_ids, cu, step.kv_lens - 1, rows.state_slots, step.kv_rows, 1,
                         step.kv_slots, attn_backend=PaddedDecodeBackend(cache_key, rows))  # type: ignore[arg-type]
    out = run_mtp_layer(model.model.mtp_layers, index, step.next_ids, step.hidden, cu, batch,
                        positions=step.kv_lens - 1)
    logits = model.mtp_logits(index, out if with_logits else out[:0]).float()
    return MTPOutput(out, logits)


class MTPGraphs:
    """The compiled MTP steps of a model with one MTP layer over its MTP cache: draft steps per bucket, catch-up
    steps per bucket of windows `width` tokens wide."""

    def __init__(self, model: KimiForCausalLM, cache: HybridCache, scratch_kv_row: int, buckets: Sequence[int],
                 width: int) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"batch-size buckets must be >= 1, got {list(buckets)}")
        if model.config.num_nextn_predict_layers != 1:
            raise ValueError("the compiled MTP steps cover a model with one MTP layer")
        self.model, self.cache, self.scratch_kv_row, self.width = model, cache, scratch_kv_row, width
        self.key = next(_NEXT_KEY)
        _CACHES[self.key] = cache
        self.device = model.device
        self.cuda = self.device.type == "cuda"
        self.buckets = sorted(set(buckets))
        self.mode = "reduce-overhead" if self.cuda else "default"
        # One code object for both kinds and every bucket, and the dynamic KV length.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * len(self.buckets))
        self._draft = self._compiled(True)
        self._catch_up = self._compiled(False)
        self.report = CaptureReport(self.mode, {})
        self.replays = 0  # steps served (tests check that a path ran through the graphs)

    def _compiled(self, with_logits: bool) -> Callable[[PaddedMTP], MTPOutput]:
        # The flag is a closure constant (guarded by value), never a graph input.
        def step(rows: PaddedMTP) -> MTPOutput:
            return padded_mtp_step(self.model, self.key, 0, rows, with_logits)

        return torch.compile(step, fullgraph=True, options=compile_options(self.cuda))

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """Compile every (kind, bucket) now, on rows that touch only the scratch KV row."""
        for b in self.buckets:
            start = time.perf_counter()
            for _ in range(2):  # compile, then replay once (on CUDA the first replays record the graph)
                for fn, rows in ((self._draft, b), (self._catch_up, b * self.width)):
                    self._call(fn, self._scratch_rows(rows))
            self.report.seconds[b] = time.perf_counter() - start
            log.info("mtp graphs: batch %d compiled in %.1f s (%s)", b, self.report.seconds[b], self.mode)
        return self.report

    def _scratch_rows(self, r: int) -> PaddedMTP:
        dev, row = self.device, self.scratch_kv_row
        ids = torch.zeros(r, dtype=torch.int64, device=dev)
        hidden = torch.zeros(r, self.model.config.hidden_size, dtype=self.model.lm_head.weight.dtype, device=dev)
        return PaddedMTP(ids, hidden, ids + row, torch.full((r, self._kv_width(2)), row, dtype=torch.int64,
                                                             device=dev), ids + 2)

    def _kv_width(self, longest: int) -> int:
        if self.cuda:  # as DecodeGraphs: one CUDA graph per power of two
            return 1 << max(longest - 1, 1).bit_length()
        return -(-longest // 16) * 16

    @torch.inference_mode()
    def _call(self, fn: Callable[[PaddedMTP], MTPOutput], rows: PaddedMTP) -> MTPOutput:
        torch._dynamo.mark_static(rows.next_ids, 0)
        torch._dynamo.mark_dynamic(rows.kv_rows, 1)
        if self.cuda:
            torch.compiler.cudagraph_mark_step_begin()
        return fn(rows)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _kv(self, block_table: Tensor, page_size: int, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """KV slot, row table [R, S] and length of rows at `positions` [R] of sequences `block_table` [R, P]."""
        lens = positions + 1
        pos = torch.minimum(torch.arange(self._kv_width(int(lens.max())), device=self.device)[None, :],
                            positions[:, None])
        rows = block_table.gather(1, pos // page_size) * page_size + pos % page_size
        slots = rows.gather(1, positions[:, None]).squeeze(1)
        return slots, rows, lens

    def _pad(self, x: Tensor, r: int, fill: float) -> Tensor:
        return torch.cat([x, x.new_full((r - x.shape[0], *x.shape[1:]), fill)]) if r > x.shape[0] else x

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
        step = PaddedMTP(self._pad(next_ids, b, 0), self._pad(hidden, b, 0), self._pad(slots, b, kv),
                         self._pad(rows, b, kv), self._pad(lens, b, 1))
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
        step = PaddedMTP(self._pad(next_ids.reshape(-1), r, 0), self._pad(hidden.reshape(n * w, -1), r, 0),
                         self._pad(slots, r, kv), self._pad(rows, r, kv), self._pad(lens, r, 1))
        self.replays += 1
        return self._call(self._catch_up, step).hidden[: n * w].view(n, w, -1)
