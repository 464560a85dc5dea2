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
from functools import cache

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
    return torch.where(s == 0, 2.0**-127, normal)


@cache
def _byte_pairs(kind: str, dtype: torch.dtype, device: torch.device) -> Tensor:
    """[256, 2]: what each packed byte's two nibbles stand for (low nibble first), built once per format, dtype
    and device (the decode step dequantises every expert it routes to, three times a layer)."""
    if kind == "mxfp4":  # -0.0 for code 8, as the library
        nibble = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=dtype, device=device)
    else:  # int4: q + 8 in a nibble
        nibble = torch.arange(-8, 8, dtype=dtype, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack((nibble[byte & 0xF], nibble[byte >> 4]), dim=-1)


def _lookup(kind: str, byte: Tensor, dtype: torch.dtype) -> Tensor:
    """[..., R, B] packed bytes -> [..., R, 2B / GROUP, GROUP] values: one lookup a byte, both its values."""
    pairs = _byte_pairs(kind, dtype, byte.device)[byte.long()]
    return pairs.view(*byte.shape[:-1], byte.shape[-1] * 2 // GROUP, GROUP)


def dequant_mxfp4(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """[..., R, C/2] uint8 codes and [..., R, C/32] uint8 exponents -> [..., R, C]."""
    return (_lookup("mxfp4", data, torch.float32) * e8m0_to_float(scale)[..., None]).flatten(-2).to(dtype)


def dequant_int4(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """[..., R, C/8] int32 and [..., R, C/32] scales -> [..., R, C], read as bytes: element 2j is byte j's low
    nibble, as a little-endian machine stores the words."""
    if sys.byteorder != "little":
        raise NotImplementedError("INT4 packed weights are read as little-endian bytes")
    q = _lookup("int4", data.contiguous().view(torch.uint8), scale.dtype)
    return (q * scale[..., None]).flatten(-2).to(dtype)


def dequant_fp8_block(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """[..., R, C] float8_e4m3fn and [..., ceil(R/128), ceil(C/128)] scales -> [..., R, C]."""
    r, c = data.shape[-2:]
    full = scale.repeat_interleave(BLOCK, dim=-2)[..., :r, :].repeat_interleave(BLOCK, dim=-1)[..., :c]
    return (data.to(scale.dtype) * full).to(dtype)
