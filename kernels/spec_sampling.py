"""Speculative verification: from the target's logits at the k+1 verified positions of each request and the k
draft tokens, the accepted length and the emitted tokens.

Position j of a request is sampled as the plain sampler (`kernels/sampling.py`) would sample it with the drafts
before j appended to the request's history: grammar mask and bans, penalties, temperature, top-k / top-p /
min-p. Greedy rows (temperature below 1e-5 or top_k == 1) accept drafts while each equals the target's argmax, so the
output equals plain greedy decoding token for token. Sampled rows use speculative (rejection) sampling, which
keeps the target distribution p_j exactly: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)) (q_j: the
drafter's distribution, or a point mass at d_j for drafters without one, e.g. n-gram); on the first rejection
emit a draw from norm(max(p_j - q_j, 0)) and stop; when all drafts are accepted, emit a draw from p_k (the bonus).

Randomness is counter-based as in the plain sampler (`hash_uniform(seed, step, token)`, step = the output index
of the position), on two streams derived from the row's seed: one for the accept coins, one for the
residual / bonus draws. Both differ from the plain sampler's stream, so a drafter that samples its drafts
with `sample()` and the same seeds stays independent of the verifier's randomness (rejection sampling needs
the coin and the residual draw independent of the draft).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kernels.sampling import (
    LogitBias,
    TokenMask,
    banned_logits,
    biased_logits,
    hash_uniform,
    masked_logits,
    output_counts,
    penalized,
)
from kernels.sampling_tensors import SamplingTensors, cutoffs, tempered

ACCEPT_SALT = 0x2545F4914F6CDD1D  # xor-ed into the seed: both < 2**63, so the seed stays a valid int64
DRAW_SALT = 0x1B873593CC9E2D51


class VerifyResult(NamedTuple):
    num_accepted: Tensor  # [N] int64, drafts accepted, in 0..num_drafts[i]
    tokens: Tensor  # [N, K+1] int64: the first num_accepted[i] + 1 are emitted, the rest are -1
    logprobs: Tensor  # [N, K+1] fp32, log-softmax of the raw logits at each emitted token (NaN past them)
    top_ids: Tensor  # [N, K+1, t] int64 (t = top_logprobs_num, may be 0)
    top_logprobs: Tensor  # [N, K+1, t] fp32


def _position_bans(banned: list[list[list[int]]] | None, n: int, width: int) -> list[list[int]] | None:
    if banned is None:
        return None
    if len(banned) != n:
        raise ValueError(f"banned ids for {len(banned)} requests, {n} in the batch")
    return [req[j] if j < len(req) else [] for req in banned for j in range(width)]


def _position_counts(histories: list[list[int]], drafts: Tensor, valid: Tensor, vocab: int) -> Tensor:
    """[N * (K+1), V] occurrence counts at each position: the request's history plus the drafts before it."""
    n, k = drafts.shape
    base = output_counts(histories, vocab, drafts.device)
    onehot = torch.zeros(n, k, vocab, device=drafts.device)
    onehot.scatter_(2, drafts[..., None], valid.float()[..., None])
    before = torch.cat([torch.zeros(n, 1, vocab, device=drafts.device), onehot.cumsum(1)], 1)
    return (base[:, None] + before).reshape(n * (k + 1), vocab)


def kept(z: Tensor, p: SamplingTensors) -> Tensor:
    """[M, V] bool: the tokens a sampled row may draw, exactly as `select_torch` keeps them."""
    zmax = z.max(-1, keepdim=True).values
    keep = z >= cutoffs(z, p)[:, None]
    return keep & ((p.min_p[:, None] <= 0) | (z >= zmax + torch.log(p.min_p[:, None])))


def plain_greedy(p: SamplingTensors, banned: list[list[list[int]]] | None, mask: TokenMask | None,
                 bias: LogitBias | None = None) -> bool:
    """Every position greedy with nothing that changes its logits (penalties, bans, a grammar mask, a logit
    bias): then acceptance is an argmax compare on the raw logits, without the sampler's per-position tensors."""
    if mask is not None or (bias is not None and bias.rows.numel()) \
            or (banned is not None and any(b for req in banned for b in req)):
        return False
    return bool(p.greedy.all()) and not p.has_penalties()


def _general(logits: Tensor, safe: Tensor, valid: Tensor, p: SamplingTensors, histories: list[list[int]] | None,
             banned: list[list[list[int]]] | None, draft_probs: Tensor | None, mask: TokenMask | None,
             bias: LogitBias | None) -> tuple[Tensor, Tensor]:
    """Acceptance with the full sampler: -> (accept [N, K] before the validity mask, own token [N, K+1])."""
    n, width, vocab = logits.shape
    k = width - 1
    dev = logits.device
    counts = _position_counts(histories or [[]] * n, safe, valid, vocab) if p.has_penalties() else None

    flat = logits.reshape(n * width, vocab)
    masked = masked_logits(flat, mask)
    drawable = banned_logits(masked, _position_bans(banned, n, width), copy=masked is flat)
    drawable = biased_logits(drawable, bias, copy=drawable is flat)
    adjusted = penalized(drawable, p, counts)
    argmax = adjusted.argmax(-1).view(n, width)
    greedy = p.greedy.view(n, width)
    accept = safe == argmax[:, :k]
    own = argmax  # each position's own token (the one emitted right after the accepted drafts)

    if not bool(p.greedy.all()):
        z = tempered(adjusted, p)
        keep = kept(z, p)
        probs = torch.where(keep, z, float("-inf")).softmax(-1).view(n, width, vocab)[:, :k]
        p_d = probs.gather(2, safe[..., None])[..., 0]
        if draft_probs is None:
            q_d = torch.ones_like(p_d)
            resid = probs.scatter(2, safe[..., None], 0.0)  # p without the draft, renormalised by the draw
        else:
            q = draft_probs.to(dev).float()
            q_d = q.gather(2, safe[..., None])[..., 0]
            resid = (probs - q).clamp(min=0.0)
        coin = hash_uniform(p.seed ^ ACCEPT_SALT, p.step, 1).view(n, width)[:, :k]
        accept = torch.where(greedy[:, :k], accept, coin * q_d < p_d)  # u < p / q, no division by q = 0
        gumbel = -torch.log(-torch.log(hash_uniform(p.seed ^ DRAW_SALT, p.step, vocab)))
        bonus = torch.where(keep, z + gumbel, float("-inf")).argmax(-1).view(n, width)
        resid_draw = (resid.log() + gumbel.view(n, width, vocab)[:, :k]).argmax(-1)
        # p == q to the last bit leaves no residual; such a draft is accepted unless rounding says otherwise
        resid_draw = torch.where(resid.sum(-1) > 0, resid_draw, bonus[:, :k])
        drawn = torch.where(valid, resid_draw, bonus[:, :k])
        own = torch.where(greedy, argmax, torch.cat([drawn, bonus[:, k:]], 1))

    return accept, own


def verify_drafts(
    logits: Tensor, drafts: Tensor, num_drafts: Tensor, params: SamplingTensors,
    histories: list[list[int]] | None = None, banned: list[list[list[int]]] | None = None,
    draft_probs: Tensor | None = None, mask: TokenMask | None = None, top_logprobs_num: int = 0,
    bias: LogitBias | None = None,
) -> VerifyResult:
    """logits [N, K+1, V] (raw target logits; position j of window i predicts output index `params.step` of
    row i * (K+1) + j); drafts [N, K] int64 (entries past num_drafts[i] ignored); num_drafts [N] int64 in
    [0, K]; params: the sampling parameters of every position, row i * (K+1) + j for position j of window i
    (the rows of positions past num_drafts[i] + 1 are never emitted: any values); histories[i]: the tokens
    generated before position 0 (None: none); banned[i][j]: ids position j may not draw; draft_probs
    [N, K, V]: the drafter's distributions (None: point masses at the drafts); mask: a grammar mask whose rows
    index the flattened positions i * (K+1) + j, and so do the rows of `bias` (logit biases)."""
    n, width, vocab = logits.shape
    k = width - 1
    dev = logits.device
    if drafts.shape != (n, k) or num_drafts.shape != (n,):
        raise ValueError(f"drafts {tuple(drafts.shape)} / num_drafts {tuple(num_drafts.shape)} for logits "
                         f"{tuple(logits.shape)}")
    if params.num_rows != n * width:
        raise ValueError(f"sampling parameters for {params.num_rows} positions, {n} windows of {width}")
    num_drafts = num_drafts.to(dev)
    valid = torch.arange(k, device=dev)[None] < num_drafts[:, None]  # [N, K]
    safe = torch.where(valid, drafts.to(dev), 0)  # ignored entries may be any id: index with 0 instead
    if plain_greedy(params, banned, mask, bias):
        own = logits.argmax(-1)  # nothing adjusts a plain greedy row's logits: the general path's argmax
        accept = safe == own[:, :k]
    else:
        accept, own = _general(logits, safe, valid, params, histories, banned, draft_probs, mask, bias)
    accept &= valid
    num_accepted = accept.long().cumprod(1).sum(1)
    pos = torch.arange(width, device=dev)[None]
    a = num_accepted[:, None]
    with_drafts = torch.cat([safe, torch.zeros(n, 1, dtype=torch.int64, device=dev)], 1)
    tokens = torch.where(pos < a, with_drafts, torch.where(pos == a, own, -1))

    logprobs_all = logits.float().log_softmax(-1)
    chosen = logprobs_all.gather(2, tokens.clamp(min=0)[..., None])[..., 0]
    chosen = torch.where(pos <= a, chosen, float("nan"))
    if top_logprobs_num > 0:
        top = logprobs_all.topk(top_logprobs_num, dim=-1)
        return VerifyResult(num_accepted, tokens, chosen, top.indices, top.values)
    empty = torch.empty(n, width, 0, device=dev)
    return VerifyResult(num_accepted, tokens, chosen, empty.long(), empty)
