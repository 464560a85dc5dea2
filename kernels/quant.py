"""Dequantise selected experts of packed, stacked weights (compressed-tensors formats) into a compute dtype:
the torch references and the dispatch to the Triton kernels (`quant_triton`, CUDA).

Stacked layout: data [E, R, C / pack] and scale [E, SR, SC] for E experts of [R, C] weights; `ids` [A] selects
experts, the result is [A, R, C]. Formats (`kind`, see `radixk3.quant_format`):
- "mxfp4": data uint8, two e2m1 codes a byte (element 2i the low nibble; code bit 3 the sign, bits 0-2 index
  0, .5, 1, 1.5, 2, 3, 4, 6); scale uint8 e8m0 [E, R, C / 32], 2^(s - 127).
- "int4": data int32, element i of a word at bits 4i..4i+3 holding q + 8; scale [E, R, C / 32] (float).
- "fp8": data float8_e4m3fn [E, R, C]; scale [E, ceil(R / 128), ceil(C / 128)] (float), one per block.
value = q * scale, computed in the scale's dtype as compressed-tensors' `dequantize` does (mxfp4: in fp32,
exact: an e2m1 value times a power of two), then cast to `dtype`. Bit for bit the library's decompression.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from kernels.backend import kernel_backend

KINDS = ("mxfp4", "int4", "fp8")
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
BLOCK = 128  # fp8 block rows and cols
GROUP = 32  # mxfp4 / int4 inputs per scale


def dequant_experts(kind: str, data: Tensor, scale: Tensor, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """The experts `ids` of (data, scale) as [A, R, C] weights in `dtype`."""
    if kind not in KINDS:
        raise ValueError(f"unknown packed format {kind!r}; expected one of {KINDS}")
    if kernel_backend(data.device) == "triton":
        from kernels.quant_triton import dequant_experts_triton

        return dequant_experts_triton(kind, data, scale, ids, dtype)
    return {"mxfp4": dequant_mxfp4, "int4": dequant_int4, "fp8": dequant_fp8_block}[kind](data[ids], scale[ids], dtype)


def e8m0_to_float(scale: Tensor) -> Tensor:
    """2^(s - 127) in fp32 for uint8 s, from the bits (s = 0 is 2^-127, a subnormal)."""
    s = scale.to(torch.int32)
    normal = (s << 23).view(torch.float32)
    return torch.where(s == 0, torch.tensor(2.0**-127), normal)


def _byte_pairs(low: Tensor, high: Tensor) -> Tensor:
    """[256, 2]: what each byte's two nibbles stand for (low nibble first), from the 16 values of a nibble."""
    byte = torch.arange(256, device=low.device)
    return torch.stack((low[byte & 0xF], high[byte >> 4]), dim=-1)


def dequant_mxfp4(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """[..., R, C/2] uint8 codes and [..., R, C/32] uint8 exponents -> [..., R, C]. One lookup per byte (its two
    values at once) rather than one per nibble: the CPU decode step dequantises every expert it routes to."""
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), device=data.device)  # -0.0 for code 8, as the library
    values = _byte_pairs(table, table)[data.long()].view(*data.shape[:-1], data.shape[-1] * 2 // GROUP, GROUP)
    return (values * e8m0_to_float(scale)[..., None]).flatten(-2).to(dtype)


def unpack_int4(data: Tensor) -> Tensor:
    """[..., R, C/8] int32 words -> [..., R, C] int8 q in [-8, 7]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=data.device)
    return (((data[..., None] >> shifts) & 0xF) - 8).flatten(-2).to(torch.int8)


def dequant_int4(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """[..., R, C/8] int32 and [..., R, C/32] scales -> [..., R, C]. Read as bytes (element 2j is byte j's low
    nibble on a little-endian machine), one lookup a byte, as `dequant_mxfp4`."""
    if sys.byteorder != "little":
        q = unpack_int4(data).to(scale.dtype).unflatten(-1, (-1, GROUP))
        return (q * scale[..., None]).flatten(-2).to(dtype)
    nibble = torch.arange(-8, 8, dtype=scale.dtype, device=data.device)
    byte = data.contiguous().view(torch.uint8)  # [..., R, C/2]
    q = _byte_pairs(nibble, nibble)[byte.long()].view(*byte.shape[:-1], byte.shape[-1] * 2 // GROUP, GROUP)
    return (q * scale[..., None]).flatten(-2).to(dtype)


def dequant_fp8_block(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """[..., R, C] float8_e4m3fn and [..., ceil(R/128), ceil(C/128)] scales -> [..., R, C]."""
    r, c = data.shape[-2:]
    full = scale.repeat_interleave(BLOCK, dim=-2)[..., :r, :].repeat_interleave(BLOCK, dim=-1)[..., :c]
    return (data.to(scale.dtype) * full).to(dtype)
