"""Triton sampling: kernel 1 applies penalties per (row, vocab block) and notes each block's largest value;
kernel 2 tempers, z = (x - row max) / T, as the torch path's `tempered` (so that no temperature overflows z);
top-k / top-p cut-offs come from a torch sort of only the rows that use them; kernel 3 per row finds z_max, then
the masked Gumbel-max draw (or the argmax for greedy rows) with the same counter-based hash as the torch path, so
both backends pick the same tokens."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.sampling_tensors import HASH_MUL1, HASH_MUL2, MASK32, SamplingTensors, cutoffs, finite_max
from kernels.triton_launch import kernel

BLOCK_V = 1024


@kernel
def _penalize_kernel(
    logits, counts, x_out, block_max, freq, pres, rep, V, NB, HAS_COUNTS: tl.constexpr, BV: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BV + tl.arange(0, BV)
    m = offs < V
    x = tl.load(logits + row * V + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_COUNTS:
        c = tl.load(counts + row * V + offs, mask=m, other=0.0)
        seen = c > 0
        x = x - tl.load(freq + row) * c - tl.load(pres + row) * tl.where(seen, 1.0, 0.0)
        r = tl.load(rep + row)
        x = tl.where(seen, tl.where(x > 0, x / r, x * r), x)
    tl.store(x_out + row * V + offs, x, mask=m)
    tl.store(block_max + row * NB + blk, tl.max(tl.where(m, x, float("-inf")), axis=0))


@kernel
def _temper_kernel(z, shift, temperature, greedy, V, BV: tl.constexpr):
    """In place: z = (x - shift) / T for sampled rows; greedy rows keep x (their shift is 0, their T 1)."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BV + tl.arange(0, BV)
    m = offs < V
    x = tl.load(z + row * V + offs, mask=m, other=0.0)
    temp = tl.where(tl.load(greedy + row) != 0, 1.0, tl.load(temperature + row))
    tl.store(z + row * V + offs, (x - tl.load(shift + row)) / temp, mask=m)


@kernel
def _select_kernel(
    z, cut, min_p, greedy, seed, step, out, V, M1: tl.constexpr, M2: tl.constexpr, MASK: tl.constexpr,
    BV: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    zmax = tl.full([BV], float("-inf"), dtype=tl.float32)
    for start in range(0, V, BV):
        offs = start + tl.arange(0, BV)
        zmax = tl.maximum(zmax, tl.load(z + row * V + offs, mask=offs < V, other=float("-inf")))
    zm = tl.max(zmax, axis=0)
    is_greedy = tl.load(greedy + row) != 0
    mp = tl.load(min_p + row)
    floor = tl.maximum(tl.load(cut + row), tl.where(mp > 0, zm + tl.log(tl.maximum(mp, 1e-30)), float("-inf")))
    s = tl.load(seed + row)
    h = s >> 32
    h = h ^ (h >> 16)
    h = (h * M1) & MASK
    h = h ^ (h >> 15)
    h = (h * M2) & MASK
    h = h ^ (h >> 16)
    h = (s & MASK) ^ h
    h = h ^ (h >> 16)
    h = (h * M1) & MASK
    h = h ^ (h >> 15)
    h = (h * M2) & MASK
    h = h ^ (h >> 16)
    h = h ^ (tl.load(step + row) & MASK)
    h = h ^ (h >> 16)
    h = (h * M1) & MASK
    h = h ^ (h >> 15)
    h = (h * M2) & MASK
    h_row = h ^ (h >> 16)
    best = tl.full([BV], float("-inf"), dtype=tl.float32)
    best_i = tl.zeros([BV], dtype=tl.int64)
    for start in range(0, V, BV):
        offs = start + tl.arange(0, BV)
        m = offs < V
        zv = tl.load(z + row * V + offs, mask=m, other=float("-inf"))
        x = h_row ^ offs.to(tl.int64)
        x = x ^ (x >> 16)
        x = (x * M1) & MASK
        x = x ^ (x >> 15)
        x = (x * M2) & MASK
        x = x ^ (x >> 16)
        u = ((x >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
        score = tl.where(is_greedy, zv, tl.where(zv >= floor, zv - tl.log(-tl.log(u)), float("-inf")))
        score = tl.where(m, score, float("-inf"))
        better = score > best  # strict: the first index wins ties, as torch.argmax
        best_i = tl.where(better, offs.to(tl.int64), best_i)
        best = tl.where(better, score, best)
    top = tl.max(best, axis=0)
    pick = tl.min(tl.where(best == top, best_i, V), axis=0)
    tl.store(out + row, pick)


def sample_tokens_triton(logits: Tensor, p: SamplingTensors, counts: Tensor | None) -> Tensor:
    n, vocab = logits.shape
    blocks = triton.cdiv(vocab, BLOCK_V)
    z = torch.empty(n, vocab, dtype=torch.float32, device=logits.device)
    block_max = torch.empty(n, blocks, dtype=torch.float32, device=logits.device)
    greedy = p.greedy.to(torch.int32)
    lc = logits.contiguous()
    _penalize_kernel[(n, blocks)](
        lc, counts if counts is not None else lc, z, block_max, p.frequency_penalty, p.presence_penalty,
        p.repetition_penalty, vocab, blocks, HAS_COUNTS=counts is not None, BV=BLOCK_V,
    )  # fmt: skip
    shift = torch.where(p.greedy, 0.0, finite_max(block_max)).contiguous()  # as `tempered`
    _temper_kernel[(n, blocks)](z, shift, p.temperature, greedy, vocab, BV=BLOCK_V)
    cut = cutoffs(z, p)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    bv = min(BLOCK_V, triton.next_power_of_2(vocab))
    _select_kernel[(n,)](
        z, cut, p.min_p, greedy, p.seed, p.step, out, vocab, M1=HASH_MUL1, M2=HASH_MUL2, MASK=MASK32, BV=bv
    )
    return out
