"""Weight-only int8 / int4 GEMMs on torch's CPU kernels, with the dequantise-then-matmul torch references that are
their oracles.

A weight is [N, K] (N outputs, K inputs, as `F.linear` takes it); y = x W^T for x [..., K] in the model dtype
(fp32 or bf16; scales and zeros in the same dtype), products accumulated in fp32, the result in x's dtype. Both
CPU kernels are vectorised for bf16 activations only: with fp32 ones they take a scalar loop, several times slower
than the dense GEMM (serve quantised models with --dtype bfloat16). They are not rounded to bf16 for speed behind
the caller's back: a tensor-parallel partial sum would then be rounded where the unsharded product is not.
- int8: symmetric, one scale per output row: W[n] = q[n] * scale[n], q in [-127, 127] (llama.cpp's Q8_0 rounding,
  per row instead of per 32). `torch.ops.aten._weight_int8pack_mm(x, q, scales)`; it needs K % 16 == 0 (its bf16
  path reads whole vectors of 16: with other K it reads past the rows, and segfaults at some sizes).
- int4: asymmetric, one (scale, zero) per 32 inputs of a row: W[n, g*32 + i] = (q - 8) * scale + zero, q in
  [0, 15] (the convention of torch's int4 kernels and its own tests: zero = min + 8 scale). The codes are packed by
  `_convert_weight_to_int4pack_for_cpu`, which takes N in multiples of 16: rows are padded with zero scales and
  zeros up to one and the padding cut off the result. Scales and zeros stored [K/32, N16, 2];
  `_weight_int4pack_mm_for_cpu(x, packed, 32, scales_zeros)`.
Both kernels take a 2-D contiguous x; each row's result does not depend on the other rows (checked in the tests:
a sequence's logits do not depend on what it is batched with). No CUDA path yet: the kernels are the CPU ones.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

GROUP = 32  # int4 inputs per (scale, zero)
INT8_K = 16  # the int8 kernel takes K in multiples of this
INT4_ROWS = 16  # the CPU int4 packing takes N in multiples of this (padded up to one)
INNER_K_TILES = 2  # the packing's argument (the CPU layout ignores it beyond validating it)
METHODS = ("int8", "int4")


class Int8Weight(NamedTuple):
    q: Tensor  # [..., N, K] int8
    scales: Tensor  # [..., N] model dtype


class Int4Codes(NamedTuple):
    """Unpacked int4 codes: what the packing consumes and the reference dequantises."""

    q: Tensor  # [N, K] int32 in [0, 15]
    scales_zeros: Tensor  # [K / 32, N, 2] model dtype: (scale, zero) of each group


class Int4Weight(NamedTuple):
    packed: Tensor  # [N16, K / 2] uint8, the CPU kernel's layout (N16: N rounded up to 16)
    scales_zeros: Tensor  # [K / 32, N16, 2] model dtype (zero in the padding rows)
    rows: int  # N: the weight's rows (the result's columns)


def fits(method: str, k: int) -> bool:
    """Whether a weight of k inputs runs on `method`'s kernel (int4: whole groups)."""
    return k % (GROUP if method == "int4" else INT8_K) == 0


def row_amax(w: Tensor) -> Tensor:
    """[..., N] the largest |W| of each row, in fp32 (what an int8 scale is made of)."""
    return w.detach().float().abs().amax(-1)


def quantize_int8(w: Tensor, amax: Tensor | None = None) -> Int8Weight:
    """Per-row symmetric int8 of w [..., N, K]. `amax` [..., N]: each row's largest |W| over the whole row when w
    holds only some of its columns (a tensor-parallel shard), so that every shard quantises as the whole does.
    Scales are rounded to w's dtype first and the codes made from the rounded scales."""
    amax = row_amax(w) if amax is None else amax.float()
    scales = (amax / 127).clamp(min=torch.finfo(w.dtype).tiny).to(w.dtype)
    q = torch.round(w.detach().float() / scales.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scales.contiguous())


def quantize_int4(w: Tensor) -> Int4Codes:
    """Group-32 asymmetric int4 codes of w [N, K] (min-max per group), scales and zeros rounded to w's dtype first
    and the codes made from the rounded values."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"int4 needs an input dim that is a multiple of {GROUP}, got {k}")
    groups = w.detach().float().reshape(n, k // GROUP, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo).clamp(min=1e-6) / 15).to(w.dtype)
    zero = (lo + 8 * scale.float()).to(w.dtype)
    low = zero.float() - 8 * scale.float()  # the value of code 0, as the kernel computes it
    q = torch.round((groups - low[..., None]) / scale.float()[..., None]).clamp_(0, 15).to(torch.int32)
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return Int4Codes(q.reshape(n, k), scales_zeros)


def pack_int4(codes: Int4Codes) -> Int4Weight:
    n, k = codes.q.shape
    pad = -n % INT4_ROWS
    q = torch.nn.functional.pad(codes.q, (0, 0, 0, pad))
    scales_zeros = torch.nn.functional.pad(codes.scales_zeros, (0, 0, 0, pad))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.cpu(), INNER_K_TILES)
    return Int4Weight(packed.to(codes.q.device), scales_zeros.contiguous(), n)


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _check_cpu(x: Tensor) -> None:
    if x.device.type != "cpu":
        raise NotImplementedError(f"weight-only int8 / int4 runs on the CPU kernels only, not on {x.device}")


def int8_mm(x: Tensor, w: Int8Weight) -> Tensor:
    """x [..., K] @ W^T for an int8 weight [N, K] (scales in x's dtype) -> [..., N] in x's dtype."""
    _check_cpu(x)
    if not fits("int8", w.q.shape[-1]):
        raise ValueError(f"the int8 kernel needs K % {INT8_K} == 0, got K = {w.q.shape[-1]}")
    y = torch.ops.aten._weight_int8pack_mm(_rows(x), w.q, w.scales)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def int4_mm(x: Tensor, w: Int4Weight) -> Tensor:
    """x [..., K] @ W^T for a packed int4 weight [N, K] (scales in x's dtype) -> [..., N] in x's dtype."""
    _check_cpu(x)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(_rows(x), w.packed, GROUP, w.scales_zeros)
    if y.shape[-1] != w.rows:
        y = y[:, : w.rows]
    return y.reshape(*x.shape[:-1], w.rows)


def dequant_int8(w: Int8Weight) -> Tensor:
    """The fp32 weight an int8 one stands for."""
    return w.q.float() * w.scales.float()[..., None]


def dequant_int4(codes: Int4Codes) -> Tensor:
    """The fp32 weight int4 codes stand for: (q - 8) * scale + zero, per group."""
    n, k = codes.q.shape
    sz = codes.scales_zeros.float().transpose(0, 1)  # [N, K/32, 2]
    q = codes.q.float().reshape(n, k // GROUP, GROUP)
    return ((q - 8) * sz[..., :1] + sz[..., 1:]).reshape(n, k)


def reference_mm(x: Tensor, w_fp32: Tensor) -> Tensor:
    """The oracle of both kernels: the dequantised weight, an fp32 matmul, the result in x's dtype."""
    return (x.float() @ w_fp32.t()).to(x.dtype)
