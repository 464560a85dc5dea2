"""Chunked (WY/UT) KDA in plain torch: the chunk plan and the inter-chunk scan.

Each sequence is cut into chunks of `chunk_size` tokens from its start, plus extra cuts where a caller wants the
state (checkpoints), so a checkpoint is always a chunk end and needs no special maths. Chunks are padded with
zero tokens (k = v = 0, g = 0, beta = 0), which is exact: they leave the state untouched. A rank whose chunks
are all short (a sequence's tail, a short prompt) is padded only to the next 16 x 2^k tokens: the chunk
boundaries stay where they were, and the padding rows only ever add exact zeros, so its outputs and states are
the same bits as at the full width, at a fraction of the work. The intra-chunk terms are in `kda_intra`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kernels.kda_intra import SUB, intra_terms

_INTRA_BUDGET = 1 << 18  # elements of the largest intra-chunk temporary per group of chunks


class ChunkPlan(NamedTuple):
    """Chunks in (rank, sequence) order; rank r = the r-th chunk of its sequence."""

    token_index: Tensor  # [NC, C] int64 token of each chunk row; T (one past the end) marks padding
    chunk_seq: Tensor  # [NC] int64 sequence of each chunk
    rank_offsets: list[int]  # chunks of rank r are [rank_offsets[r], rank_offsets[r + 1])
    rank_full: list[bool]  # rank r holds every sequence, in order (the scan can skip its gather)
    rank_width: list[int]  # rank r's chunks are padded to this many tokens (<= chunk_size)
    emit_local: list[Tensor]  # per rank: rows (within the rank's chunks) whose end is a checkpoint
    emit_ids: list[Tensor]  # per rank: the checkpoint ids written from those rows
    initial_seq: Tensor  # checkpoints at position 0: their sequence ...
    initial_ids: Tensor  # ... and checkpoint id (the initial state itself)
    chunk_size: int


def padded_width(longest: int, chunk_size: int) -> int:
    """Tokens a rank whose longest chunk has `longest` tokens is padded to: the next 16 x 2^k, at most
    `chunk_size`. Never below 16: the triangular inverse works in 16-row blocks, so any width from 16 up
    rounds every real row the same way."""
    if chunk_size <= SUB:
        return chunk_size
    return min(chunk_size, SUB << ((max(longest, 1) - 1) // SUB).bit_length())


def plan_chunks(
    bounds: list[int],
    chunk_size: int,
    cuts: list[tuple[int, int]] | None,
    device: torch.device,
) -> ChunkPlan:
    """Plan chunks for sequences [bounds[i], bounds[i+1]); `cuts` = (sequence, offset) checkpoints, offset in
    [0, len]; checkpoint m is the state after the first `offset` tokens of its sequence."""
    blocks = chunk_size // SUB
    if not (1 <= chunk_size <= SUB or (chunk_size % SUB == 0 and blocks & (blocks - 1) == 0)):
        raise ValueError(f"chunk_size {chunk_size} must be <= {SUB} or {SUB} times a power of two")
    n = len(bounds) - 1
    per_seq_cuts: list[set[int]] = [set() for _ in range(n)]
    for seq, pos in cuts or []:
        length = bounds[seq + 1] - bounds[seq]
        if not 0 <= pos <= length:
            raise ValueError(f"checkpoint offset {pos} outside sequence {seq} of length {length}")
        per_seq_cuts[seq].add(pos)
    edges: list[list[int]] = []
    for i in range(n):
        length = bounds[i + 1] - bounds[i]
        inner = set(range(chunk_size, length, chunk_size)) | {p for p in per_seq_cuts[i] if 0 < p < length}
        edges.append([0, *sorted(inner), length] if length else [0])
    ranks = max((len(e) - 1 for e in edges), default=0)
    starts: list[int] = []
    lens: list[int] = []
    seqs: list[int] = []
    offsets = [0]
    full: list[bool] = []
    widths: list[int] = []
    where: dict[tuple[int, int], tuple[int, int]] = {}  # (seq, end offset) -> (rank, row in rank)
    for r in range(ranks):
        row = 0
        for i in range(n):
            if r + 1 < len(edges[i]):
                a, b = edges[i][r], edges[i][r + 1]
                starts.append(bounds[i] + a)
                lens.append(b - a)
                seqs.append(i)
                where[(i, b)] = (r, row)
                row += 1
        offsets.append(len(starts))
        full.append(row == n)
        widths.append(padded_width(max(lens[offsets[-2] :]), chunk_size))
    emit_local: list[list[int]] = [[] for _ in range(ranks)]
    emit_ids: list[list[int]] = [[] for _ in range(ranks)]
    init_seq: list[int] = []
    init_ids: list[int] = []
    for m, (seq, pos) in enumerate(cuts or []):
        if pos == 0:
            init_seq.append(seq)
            init_ids.append(m)
        else:
            r, row = where[(seq, pos)]
            emit_local[r].append(row)
            emit_ids[r].append(m)
    ar = torch.arange(chunk_size, dtype=torch.int64)
    start_t = torch.tensor(starts, dtype=torch.int64)
    len_t = torch.tensor(lens, dtype=torch.int64)
    idx = torch.where(ar < len_t[:, None], start_t[:, None] + ar, bounds[-1])

    def as_long(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return ChunkPlan(
        token_index=idx.to(device),
        chunk_seq=as_long(seqs),
        rank_offsets=offsets,
        rank_full=full,
        rank_width=widths,
        emit_local=[as_long(x) for x in emit_local],
        emit_ids=[as_long(x) for x in emit_ids],
        initial_seq=as_long(init_seq),
        initial_ids=as_long(init_ids),
        chunk_size=chunk_size,
    )


def _rank_groups(plan: ChunkPlan, group: int) -> list[tuple[int, int]]:
    """Consecutive ranks [r0, r1) of one padded width holding about `group` chunks (at least one rank each)."""
    out: list[tuple[int, int]] = []
    ranks = len(plan.rank_offsets) - 1
    r0 = 0
    while r0 < ranks:
        r1 = r0 + 1
        while (
            r1 < ranks
            and plan.rank_width[r1] == plan.rank_width[r0]
            and plan.rank_offsets[r1 + 1] - plan.rank_offsets[r0] <= group
        ):
            r1 += 1
        out.append((r0, r1))
        r0 = r1
    return out


def chunk_scan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    plan: ChunkPlan,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Run the plan. `states` [N, H, K, V] fp32 holds the initial states and is advanced in place to the
    final states. Returns (o [T, H, V] fp32, checkpoints [M, H, K, V] fp32 in the plan's checkpoint order).

    Chunks go through in groups of whole ranks: the intra-chunk terms of a group (parallel over its chunks
    and heads), then the group's ranks one after the other (the sequential part)."""
    t_total, h, kdim = q.shape
    vdim = v.shape[-1]
    c = plan.chunk_size
    n_ck = len(plan.initial_ids) + sum(len(x) for x in plan.emit_ids)
    ckpts = states.new_empty(n_ck, h, kdim, vdim)
    if len(plan.initial_ids):
        ckpts[plan.initial_ids] = states[plan.initial_seq]
    o = torch.empty(t_total + 1, h, vdim, dtype=torch.float32, device=q.device)  # row T takes the padding
    inputs = [x.float() for x in (q, k, v, g, beta)]
    # Training: the states advance out of place (autograd saved the old ones); copied back at the end, detached.
    functional = torch.is_grad_enabled() and any(x.requires_grad for x in inputs)
    caller_states = states
    if functional:
        states = states.clone()
    group = max(1, _INTRA_BUDGET // (h * c * max(kdim, vdim)))
    for r0, r1 in _rank_groups(plan, group):
        base, end = plan.rank_offsets[r0], plan.rank_offsets[r1]
        idx = plan.token_index[base:end, : plan.rank_width[r0]]
        pad = idx == t_total
        rows = idx.masked_fill(pad, 0)
        # [n, H, C, ...]; padding rows zeroed (k = v = g = beta = 0 leaves the state alone)
        flat = rows.reshape(-1)  # index_select: a plain row copy, several times cheaper than advanced indexing
        qc, kc, vc, gc, bc = (
            x.index_select(0, flat).view(*rows.shape, *x.shape[1:])
            .masked_fill_(pad.view(*pad.shape, *[1] * (x.dim() - 1)), 0.0).transpose(1, 2).contiguous()
            for x in inputs
        )
        terms = intra_terms(qc * scale, kc, vc, gc, bc)
        out = torch.empty(end - base, h, idx.shape[1], vdim, dtype=torch.float32, device=q.device)
        for r in range(r0, r1):
            lo, hi = plan.rank_offsets[r] - base, plan.rank_offsets[r + 1] - base
            seqs = plan.chunk_seq[lo + base : hi + base]
            s = states if plan.rank_full[r] else states[seqs]
            v_new = terms.u[lo:hi] - terms.w[lo:hi] @ s
            out[lo:hi] = terms.qg[lo:hi] @ s + terms.a_qk[lo:hi] @ v_new
            s = terms.decay[lo:hi, ..., None] * s + terms.kd[lo:hi].transpose(-1, -2) @ v_new
            if functional:
                states = s if plan.rank_full[r] else states.index_put((seqs,), s)
            elif plan.rank_full[r]:
                states.copy_(s)
            else:
                states[seqs] = s
            if len(plan.emit_ids[r]):
                ckpts[plan.emit_ids[r]] = s[plan.emit_local[r]]
        o[idx.reshape(-1)] = out.transpose(1, 2).reshape(-1, h, vdim)
    if functional:
        caller_states.copy_(states.detach())
    return o[:t_total], ckpts
