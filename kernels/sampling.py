"""Batched sampling with per-request parameters (torch reference): penalties, temperature, top-k, top-p,
min-p, per-request seeds, greedy; logprobs of the chosen tokens and top-k logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingRow:
    """One row's parameters, as SGLang names them; temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    step: int = 0  # tokens generated so far: a seeded request draws a fresh but reproducible number each step


class SampleResult(NamedTuple):
    tokens: Tensor  # [N] int64
    logprobs: Tensor  # [N] fp32, log-softmax of the raw logits at the chosen token
    top_ids: Tensor  # [N, k] int64 (k = top_logprobs_num, may be 0)
    top_logprobs: Tensor  # [N, k] fp32


def apply_penalties(logits: Tensor, rows: list[SamplingRow], history: list[list[int]]) -> Tensor:
    """OpenAI-style frequency/presence penalties and CTRL-style repetition penalty over generated tokens."""
    out = logits.clone()
    for i, (p, hist) in enumerate(zip(rows, history, strict=True)):
        if not hist or (p.frequency_penalty == 0 and p.presence_penalty == 0 and p.repetition_penalty == 1):
            continue
        ids = torch.tensor(hist, device=logits.device)
        counts = torch.bincount(ids, minlength=logits.shape[-1]).to(logits.dtype)
        seen = counts > 0
        out[i] -= p.frequency_penalty * counts + p.presence_penalty * seen.to(logits.dtype)
        if p.repetition_penalty != 1:
            row = out[i]
            pen = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            out[i] = torch.where(seen, pen, row)
    return out


def _filter(probs: Tensor, p: SamplingRow) -> Tensor:
    """Zero out what top-k, top-p and min-p exclude (probs of one row, sorted descending order not assumed)."""
    sorted_p, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if p.top_k > 0:
        keep[p.top_k :] = False
    if p.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        keep &= (sorted_p.cumsum(0) - sorted_p) < p.top_p
    if p.min_p > 0.0:
        keep &= sorted_p >= p.min_p * sorted_p[0]
    keep[0] = True
    out = torch.zeros_like(probs)
    out[order[keep]] = sorted_p[keep]
    return out


def sample(
    logits: Tensor, rows: list[SamplingRow], history: list[list[int]] | None = None, top_logprobs_num: int = 0
) -> SampleResult:
    """logits [N, V] -> one token per row. Logprobs are of the unpenalised, untempered distribution."""
    logits = logits.float()
    logprobs_all = logits.log_softmax(-1)
    adjusted = apply_penalties(logits, rows, history) if history is not None else logits
    tokens = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
    for i, p in enumerate(rows):
        if p.temperature <= 0.0 or p.top_k == 1:
            tokens[i] = adjusted[i].argmax()
            continue
        probs = _filter((adjusted[i] / p.temperature).softmax(-1), p)
        gen = None
        if p.seed is not None:
            gen = torch.Generator(device=logits.device).manual_seed((p.seed * 1_000_003 + p.step) % (2**63))
        tokens[i] = torch.multinomial(probs, 1, generator=gen)[0]
    chosen = logprobs_all.gather(1, tokens[:, None])[:, 0]
    if top_logprobs_num > 0:
        top = logprobs_all.topk(top_logprobs_num, dim=-1)
        top_ids, top_lp = top.indices, top.values
    else:
        top_ids = torch.empty(len(rows), 0, dtype=torch.int64, device=logits.device)
        top_lp = torch.empty(len(rows), 0, device=logits.device)
    return SampleResult(tokens, chosen, top_ids, top_lp)
