"""Batched sampling with per-request parameters: penalties, temperature, top-k, top-p, min-p, per-request
seeds, greedy; logprobs of the chosen tokens and top-k logprobs.

Steps per row: penalties on the raw logits (frequency and presence: OpenAI style; repetition: CTRL style,
over the row's generated tokens); greedy (temperature below GREEDY_BELOW = 1e-5, or top_k == 1) takes the argmax;
otherwise z = (logits - max logit) / temperature (log-space, shifted so that no temperature overflows it) and the
kept set is z >= the row's cut-off (top-k: the k-th largest z, top-p: the
smallest z of the shortest prefix by probability whose mass reaches top_p, min-p: p >= min_p * p_max; ties
at a cut-off are kept), then a Gumbel-max draw: argmax over kept tokens of z + G, G = -log(-log u).
u comes from a counter-based hash of (seed, step, token id), so a seeded request draws the same tokens
whatever batch it shares and on either backend; unseeded rows get a seed from torch's global generator.
Logprobs are of the raw (unpenalised, untempered, unbanned, unbiased) distribution: `banned` token ids (stop
tokens below min_new_tokens) and the tokens a grammar `mask` disallows are excluded from the draw only (before
penalties, temperature, top-k and top-p, for greedy and sampled rows alike), never from the reported logprobs;
a request's logit `bias` (OpenAI's and SGLang's logit_bias) is added to its row's logits at the same point.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kernels.backend import kernel_backend
from kernels.sampling_tensors import HASH_MUL1, HASH_MUL2, MASK32, SamplingTensors, cutoffs, tempered


class SampleResult(NamedTuple):
    tokens: Tensor  # [N] int64
    logprobs: Tensor  # [N] fp32, log-softmax of the raw logits at the chosen token
    top_ids: Tensor  # [N, k] int64 (k = top_logprobs_num, may be 0)
    top_logprobs: Tensor  # [N, k] fp32


class TokenMask(NamedTuple):
    """Rows `rows` may draw only the tokens whose bits are set in their row of `bitmask` (int32 [M, ceil(V/32)],
    bit t % 32 of word t // 32: token t, as xgrammar packs it)."""

    rows: Tensor  # [M] int64
    bitmask: Tensor  # [M, W] int32


class LogitBias(NamedTuple):
    """logits[rows[m], ids[m]] += values[m] (a row's ids distinct)."""

    rows: Tensor  # [M] int64
    ids: Tensor  # [M] int64
    values: Tensor  # [M] fp32

    @staticmethod
    def of(entries: list[tuple[int, int, float]] | list[list[int | float]], device: torch.device | str) -> LogitBias:
        """From (row, token id, bias) triples."""
        rows, ids, values = zip(*entries, strict=True) if entries else ((), (), ())
        return LogitBias(torch.tensor(rows, dtype=torch.int64, device=device),
                         torch.tensor(ids, dtype=torch.int64, device=device),
                         torch.tensor(values, dtype=torch.float32, device=device))


def output_counts(history: list[list[int]], vocab: int, device: torch.device) -> Tensor:
    """[N, V] fp32 occurrence counts of each row's generated tokens."""
    counts = torch.zeros(len(history), vocab, dtype=torch.float32, device=device)
    for i, hist in enumerate(history):
        if hist:
            ids = torch.tensor(hist, dtype=torch.int64, device=device)
            counts[i].index_add_(0, ids, torch.ones(len(hist), device=device))
    return counts


def _mix(x: Tensor) -> Tensor:
    """A 32-bit integer mixer on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * HASH_MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * HASH_MUL2) & MASK32
    return x ^ (x >> 16)


def hash_uniform(seed: Tensor, step: Tensor, vocab: int) -> Tensor:
    """u in (0, 1) per (row, token), [N, V] fp32, a function of (seed, step, token id) only."""
    h = _mix((seed & MASK32) ^ _mix((seed >> 32) & MASK32))
    h = _mix(h ^ (step & MASK32))
    tok = torch.arange(vocab, dtype=torch.int64, device=seed.device)
    h = _mix(h[:, None] ^ tok[None, :])
    return ((h >> 9).float() + 0.5) * 2.0**-23  # exact in fp32


def penalized(logits: Tensor, p: SamplingTensors, counts: Tensor | None) -> Tensor:
    out = logits.float().clone()
    if counts is None:
        return out
    seen = counts > 0
    out -= p.frequency_penalty[:, None] * counts + p.presence_penalty[:, None] * seen.float()
    rep = p.repetition_penalty[:, None]
    return torch.where(seen, torch.where(out > 0, out / rep, out * rep), out)


def select_torch(z: Tensor, adjusted: Tensor, p: SamplingTensors, cut: Tensor) -> Tensor:
    """Greedy rows: argmax of the penalised logits; others: the Gumbel-max draw among kept tokens."""
    if bool(p.greedy.all()):  # no draw at all: skip the [N, V] hash, the common serving case
        return adjusted.argmax(-1)
    zmax = z.max(-1, keepdim=True).values
    keep = z >= cut[:, None]
    keep &= (p.min_p[:, None] <= 0) | (z >= zmax + torch.log(p.min_p[:, None]))
    gumbel = -torch.log(-torch.log(hash_uniform(p.seed, p.step, z.shape[1])))
    drawn = torch.where(keep, z + gumbel, float("-inf")).argmax(-1)
    return torch.where(p.greedy, adjusted.argmax(-1), drawn)


def apply_penalties(logits: Tensor, p: SamplingTensors, history: list[list[int]]) -> Tensor:
    """Penalised logits [N, V] fp32 (frequency, presence and repetition penalties over generated tokens)."""
    return penalized(logits, p, output_counts(history, logits.shape[-1], logits.device))


def banned_logits(logits: Tensor, banned: list[list[int]] | None, copy: bool = True) -> Tensor:
    """`logits` with each row's banned ids at -inf (a copy if any is banned, unless `copy` is False: then in
    place); ids must be in the vocabulary."""
    if not banned or not any(banned):
        return logits
    vocab = logits.shape[1]
    rows = [i for i, ban in enumerate(banned) for _ in ban]
    cols = [t for ban in banned for t in ban]
    if any(not 0 <= t < vocab for t in cols):  # negative ids would silently ban a real token
        raise IndexError(f"banned token id outside the vocabulary [0, {vocab})")
    out = logits.clone() if copy else logits
    out[rows, cols] = float("-inf")
    return out


def biased_logits(logits: Tensor, bias: LogitBias | None, copy: bool = True) -> Tensor:
    """`logits` (fp32) with each bias added (a copy if there is any, unless `copy` is False: then in place)."""
    if bias is None or bias.rows.numel() == 0:
        return logits
    vocab = logits.shape[1]
    if bool(((bias.ids < 0) | (bias.ids >= vocab)).any()):
        raise IndexError(f"logit_bias token id outside the vocabulary [0, {vocab})")
    out = logits.float().clone() if copy or logits.dtype != torch.float32 else logits
    out[bias.rows.to(out.device), bias.ids.to(out.device)] += bias.values.to(out.device)
    return out


def masked_logits(logits: Tensor, mask: TokenMask | None) -> Tensor:
    """`logits` with the tokens each masked row's bitmask disallows at -inf (a copy if any row is masked)."""
    if mask is None or mask.rows.numel() == 0:
        return logits
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (mask.bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1  # [M, W, 32]
    allowed = bits.reshape(bits.shape[0], -1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:
        raise ValueError(f"token bitmask covers {allowed.shape[1]} ids, the vocabulary has {vocab}")
    rows = mask.rows.to(logits.device)
    out = logits.clone()
    out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
    return out


def sample(
    logits: Tensor, p: SamplingTensors, history: list[list[int]] | None = None, top_logprobs_num: int = 0,
    banned: list[list[int]] | None = None, mask: TokenMask | None = None, bias: LogitBias | None = None,
) -> SampleResult:
    """logits [N, V] -> one token per row (see the module docstring) under row i's parameters, row i of `p`;
    `history[i]`: the tokens row i generated so far (penalties); `banned[i]`: ids row i may not draw; `mask`:
    the grammar-constrained rows and the tokens they may draw; `bias`: the logit biases of the rows with one."""
    n, vocab = logits.shape
    if p.num_rows != n:
        raise ValueError(f"sampling parameters for {p.num_rows} rows, {n} rows of logits")
    counts = output_counts(history, vocab, logits.device) if history is not None and p.has_penalties() else None
    masked = masked_logits(logits, mask)
    drawable = banned_logits(masked, banned, copy=masked is logits)  # one [N, V] copy for both, not two
    drawable = biased_logits(drawable, bias, copy=drawable is logits)
    if kernel_backend(logits.device) == "triton":
        from kernels.sampling_triton import sample_tokens_triton

        tokens = sample_tokens_triton(drawable, p, counts)
    elif counts is None and bool(p.greedy.all()):
        # select_torch's greedy pick without the [N, V] passes it never reads; max's indices are argmax's (the first
        # of equal maxima) at a third of its cost here
        tokens = drawable.float().max(-1).indices
    else:
        adjusted = penalized(drawable, p, counts)
        z = tempered(adjusted, p)
        tokens = select_torch(z, adjusted, p, cutoffs(z, p))
    logprobs_all = logits.float().log_softmax(-1)
    chosen = logprobs_all.gather(1, tokens[:, None])[:, 0]
    if top_logprobs_num > 0:
        top = logprobs_all.topk(top_logprobs_num, dim=-1)
        return SampleResult(tokens, chosen, top.indices, top.values)
    empty = torch.empty(n, 0, device=logits.device)
    return SampleResult(tokens, chosen, empty.long(), empty)
