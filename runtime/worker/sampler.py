"""The worker's sampler: the penalty state of every page-table row (the tokens its request has generated, which
the frequency / presence / repetition penalties count), and sampling or draft acceptance over a step's rows
with a fallback that confines a failure to the row (the verify window) that causes it.

A row's history is set when the plan (re)assigns the row (`reset`: the request's outputs so far, so a row
reused by another request, or a request readmitted after a retraction, starts from its own outputs) and grows
by every token sampled or committed in it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

import torch
from torch import Tensor

from kernels.sampling import LogitBias, SampleResult, TokenMask, output_counts, sample
from kernels.sampling_tensors import SamplingTensors
from kernels.spec_sampling import VerifyResult, verify_drafts

RowPart = TypeVar("RowPart", TokenMask, LogitBias)
RowErrors = list[tuple[int, str]]  # (row index in the step, error): rows that failed alone


def rows_part(part: RowPart | None, lo: int, hi: int) -> RowPart | None:
    """The part of a per-row tensor tuple (a grammar mask or logit biases: `rows` first, then fields parallel to
    it) for rows [lo, hi), renumbered from 0."""
    if part is None:
        return None
    mine = (part.rows >= lo) & (part.rows < hi)
    return type(part)(part.rows[mine] - lo, *(f[mine] for f in part[1:]))


class WorkerSampler:
    def __init__(self) -> None:
        self.histories: dict[int, list[int]] = {}  # page-table row -> its request's generated tokens

    def reset(self, resets: Iterable[tuple[int, list[int]]]) -> None:
        """Rows (re)assigned by the plan: row r now belongs to a request that has generated `history` so far."""
        for row, history in resets:
            self.histories[row] = list(history)

    def counts(self, rows: Sequence[int], vocab: int, device: torch.device | str) -> Tensor:
        """[len(rows), V] occurrence counts of each row's generated tokens: what its penalties count."""
        return output_counts([self.histories.get(r, []) for r in rows], vocab, device)

    def _record(self, rows: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
        for row, toks in zip(rows, tokens, strict=True):
            self.histories.setdefault(row, []).extend(toks)

    def sample(self, logits: Tensor, params: SamplingTensors, rows: Sequence[int], banned: list[list[int]],
               top_logprobs_num: int, mask: TokenMask | None,
               bias: LogitBias | None = None) -> tuple[SampleResult, RowErrors]:
        """One token per row of `logits` (row i: page-table row rows[i], parameters row i of `params`),
        recorded in its row's history. If sampling them all at once fails, row by row: a row that cannot be
        sampled fails alone (its token is a placeholder, 0, which the scheduler discards)."""
        k = top_logprobs_num
        histories = [self.histories.get(r, []) for r in rows]
        try:
            res, errors = sample(logits, params, histories, k, banned, mask, bias), []
        except Exception:
            if not rows:
                raise
            parts: list[SampleResult] = []
            errors = []
            dev = logits.device
            for i in range(len(rows)):
                try:
                    parts.append(sample(logits[i : i + 1], params.take(torch.tensor([i], device=dev)),
                                        histories[i : i + 1], k, banned[i : i + 1], rows_part(mask, i, i + 1),
                                        rows_part(bias, i, i + 1)))
                except Exception as e:
                    errors.append((i, f"sampling failed: {type(e).__name__}: {e}"))
                    zero = torch.zeros(1, k, device=dev)
                    parts.append(SampleResult(torch.zeros(1, dtype=torch.int64, device=dev),
                                              torch.zeros(1, device=dev), zero.long(), zero))
            res = SampleResult(*(torch.cat(p) for p in zip(*parts, strict=True)))
        self._record(rows, [[t] for t in res.tokens.tolist()])
        return res, errors

    def verify(self, logits: Tensor, drafts: Tensor, num_drafts: Tensor, params: SamplingTensors,
               rows: Sequence[int], banned: list[list[list[int]]], top_logprobs_num: int,
               mask: TokenMask | None = None, draft_probs: Tensor | None = None,
               bias: LogitBias | None = None) -> tuple[VerifyResult, RowErrors]:
        """Acceptance of every window (window i: page-table row rows[i]; see `verify_drafts`); each window's
        committed tokens (its accepted drafts and the target's own token) are recorded in its row's history.
        If that fails, window by window: a window that cannot be sampled fails alone (it then commits only its
        last sampled token, which the scheduler discards)."""
        k = top_logprobs_num
        histories = [self.histories.get(r, []) for r in rows]
        try:
            res, errors = verify_drafts(logits, drafts, num_drafts, params, histories, banned, draft_probs, mask=mask,
                                        top_logprobs_num=k, bias=bias), []
        except Exception:
            if not rows:
                raise
            res, errors = self._verify_apart(logits, drafts, num_drafts, params, histories, banned, k, mask,
                                             draft_probs, bias)
        committed = (res.num_accepted + 1).tolist()
        self._record(rows, [t[:c] for t, c in zip(res.tokens.tolist(), committed, strict=True)])
        return res, errors

    @staticmethod
    def _verify_apart(logits: Tensor, drafts: Tensor, num_drafts: Tensor, params: SamplingTensors,
                      histories: list[list[int]], banned: list[list[list[int]]], k: int, mask: TokenMask | None,
                      draft_probs: Tensor | None, bias: LogitBias | None) -> tuple[VerifyResult, RowErrors]:
        parts: list[VerifyResult] = []
        errors: RowErrors = []
        dev = logits.device
        w = logits.shape[1]
        for i in range(logits.shape[0]):
            try:
                parts.append(verify_drafts(
                    logits[i : i + 1], drafts[i : i + 1], num_drafts[i : i + 1],
                    params.take(torch.arange(i * w, (i + 1) * w, device=dev)), histories[i : i + 1],
                    banned[i : i + 1], None if draft_probs is None else draft_probs[i : i + 1],
                    mask=rows_part(mask, i * w, (i + 1) * w), top_logprobs_num=k,
                    bias=rows_part(bias, i * w, (i + 1) * w)))
            except Exception as e:
                errors.append((i, f"sampling failed: {type(e).__name__}: {e}"))
                zero = torch.zeros(1, w, k, device=dev)  # on the logits' device: torch.cat with the others
                parts.append(VerifyResult(torch.zeros(1, dtype=torch.int64, device=dev),
                                          torch.zeros(1, w, dtype=torch.int64, device=dev),
                                          torch.zeros(1, w, device=dev), zero.long(), zero))
        return VerifyResult(*(torch.cat(p) for p in zip(*parts, strict=True))), errors
