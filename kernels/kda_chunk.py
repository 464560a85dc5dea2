"""Chunked (WY/UT) KDA in plain torch: the chunk plan and the inter-chunk scan.

Each sequence is cut into chunks of `chunk_size` tokens from its start, plus extra cuts where a caller wants the
state (checkpoints), so a checkpoint is always a chunk end and needs no special maths. Chunks are padded with
zero tokens (k = v = 0, g = 0, beta = 0), which is exact: they leave the state untouched. The intra-chunk terms
are in `kda_intra`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kernels.kda_intra import SUB, IntraTerms, intra_terms

_INTRA_BUDGET = 1 << 22  # elements of the largest intra-chunk temporary per group of chunks


class ChunkPlan(NamedTuple):
    """Chunks in (rank, sequence) order; rank r = the r-th chunk of its sequence."""

    token_index: Tensor  # [NC, C] int64 token of each chunk row; T (one past the end) marks padding
    chunk_seq: Tensor  # [NC] int64 sequence of each chunk
    rank_offsets: list[int]  # chunks of rank r are [rank_offsets[r], rank_offsets[r + 1])
    rank_full: list[bool]  # rank r holds every sequence, in order (the scan can skip its gather)
    emit_local: list[Tensor]  # per rank: rows (within the rank's chunks) whose end is a checkpoint
    emit_ids: list[Tensor]  # per rank: the checkpoint ids written from those rows
    initial_seq: Tensor  # checkpoints at position 0: their sequence ...
    initial_ids: Tensor  # ... and checkpoint id (the initial state itself)
    chunk_size: int


def plan_chunks(
    bounds: list[int],
    chunk_size: int,
    cuts: list[tuple[int, int]] | None,
    device: torch.device,
) -> ChunkPlan:
    """Plan chunks for sequences [bounds[i], bounds[i+1]); `cuts` = (sequence, offset) checkpoints, offset in
    [0, len]; checkpoint m is the state after the first `offset` tokens of its sequence."""
    if chunk_size % SUB and chunk_size > SUB or chunk_size < 1:
        raise ValueError(f"chunk_size {chunk_size} must be <= {SUB} or a multiple of it")
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
        emit_local=[as_long(x) for x in emit_local],
        emit_ids=[as_long(x) for x in emit_ids],
        initial_seq=as_long(init_seq),
        initial_ids=as_long(init_ids),
        chunk_size=chunk_size,
    )


def _chunked_inputs(x: Tensor, plan: ChunkPlan) -> Tensor:
    """Gather tokens [T, H, ...] into chunks [NC, H, C, ...] fp32, with a zero row for padding."""
    xf = x.float()
    padded = torch.cat([xf, xf.new_zeros(1, *xf.shape[1:])])
    return padded[plan.token_index].transpose(1, 2).contiguous()


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
    final states. Returns (o [T, H, V] fp32, checkpoints [M, H, K, V] fp32 in the plan's checkpoint order)."""
    t_total, h, kdim = q.shape
    vdim = v.shape[-1]
    c = plan.chunk_size
    n_ck = len(plan.initial_ids) + sum(len(x) for x in plan.emit_ids)
    ckpts = states.new_empty(n_ck, h, kdim, vdim)
    if len(plan.initial_ids):
        ckpts[plan.initial_ids] = states[plan.initial_seq]
    nc = plan.token_index.shape[0]
    if nc == 0:
        return q.new_zeros(t_total, h, vdim, dtype=torch.float32), ckpts
    qc, kc, gc = (_chunked_inputs(x, plan) for x in (q, k, g))
    vc = _chunked_inputs(v, plan)
    bc = _chunked_inputs(beta, plan)
    qc.mul_(scale)
    group = max(1, _INTRA_BUDGET // (h * c * min(SUB, c) * max(kdim, vdim)))
    parts = [intra_terms(*(x[s : s + group] for x in (qc, kc, vc, gc, bc))) for s in range(0, nc, group)]
    terms = IntraTerms(*(torch.cat(xs) if len(parts) > 1 else xs[0] for xs in zip(*parts, strict=True)))
    out = torch.empty(nc, h, c, vdim, dtype=torch.float32, device=q.device)
    for r in range(len(plan.rank_offsets) - 1):
        lo, hi = plan.rank_offsets[r], plan.rank_offsets[r + 1]
        seqs = plan.chunk_seq[lo:hi]
        s = states if plan.rank_full[r] else states[seqs]
        v_new = terms.u[lo:hi] - terms.w[lo:hi] @ s
        out[lo:hi] = terms.qg[lo:hi] @ s + terms.a_qk[lo:hi] @ v_new
        s = terms.decay[lo:hi, ..., None] * s + terms.kd[lo:hi].transpose(-1, -2) @ v_new
        if plan.rank_full[r]:
            states.copy_(s)
        else:
            states[seqs] = s
        if len(plan.emit_ids[r]):
            ckpts[plan.emit_ids[r]] = s[plan.emit_local[r]]
    o = torch.empty(t_total + 1, h, vdim, dtype=torch.float32, device=q.device)
    o[plan.token_index.reshape(-1)] = out.transpose(1, 2).reshape(nc * c, h, vdim)
    return o[:t_total], ckpts
