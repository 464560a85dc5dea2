"""Triton dequantisation of selected experts of packed, stacked weights (`kernels.quant` is the reference and
states the formats). One program writes a [BR, BC] tile of one selected expert: each element reads its packed
code and its scale, and computes q * scale in fp32 (exact for bf16 scales: a few bits times 8), rounded to
nearest even in the scale's dtype (what torch's product in that dtype gives), then to the output dtype (bf16
written from the bits, subnormals included, which the interpreter's cast would flush). fp8 codes are read as bytes and
decoded arithmetically (e4m3fn: bias 7, subnormals, 0x7f/0xff NaN), which is exact and runs interpreted too."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_launch import kernel

BR = 16
BC = 64
_KIND = {"mxfp4": 0, "int4": 1, "fp8": 2}


@kernel
def _dequant_kernel(
    data, scale, ids, out, R, C, DC, SR, SC,
    KIND: tl.constexpr, ROUND: tl.constexpr, OUT_BF16: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    a = tl.program_id(0)
    rows = tl.program_id(1) * BR + tl.arange(0, BR)
    cols = tl.program_id(2) * BC + tl.arange(0, BC)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    e = tl.load(ids + a).to(tl.int64)
    if KIND == 0:  # mxfp4: two e2m1 codes a byte, low nibble first; e8m0 scale per 32 inputs
        byte = tl.load(data + e * R * DC + rows[:, None] * DC + (cols // 2)[None, :], mask=mask, other=0)
        code = tl.where((cols % 2 == 0)[None, :], byte & 0xF, byte >> 4).to(tl.int32)
        mag = code & 7
        pow2 = (((mag >> 1) + 126) << 23).to(tl.float32, bitcast=True)  # 2^((mag >> 1) - 1)
        val = tl.where(mag < 2, mag.to(tl.float32) * 0.5, (1.0 + 0.5 * (mag & 1).to(tl.float32)) * pow2)
        q = val * tl.where((code & 8) != 0, -1.0, 1.0)  # a product: -0.0 for code 8 (Triton's -x is 0 - x)
        s8 = tl.load(scale + e * SR * SC + rows[:, None] * SC + (cols // 32)[None, :], mask=mask, other=127)
        s8 = s8.to(tl.int32)
        s = tl.where(s8 == 0, 5.877471754111438e-39, (s8 << 23).to(tl.float32, bitcast=True))
    elif KIND == 1:  # int4: eight (q + 8) nibbles a word, element i at bit 4i; a scale per 32 inputs
        word = tl.load(data + e * R * DC + rows[:, None] * DC + (cols // 8)[None, :], mask=mask, other=0)
        q = (((word >> ((cols % 8) * 4)[None, :]) & 0xF) - 8).to(tl.float32)
        s = tl.load(scale + e * SR * SC + rows[:, None] * SC + (cols // 32)[None, :], mask=mask, other=0.0)
        s = s.to(tl.float32)
    else:  # fp8 e4m3fn bytes; a scale per 128 x 128 block
        b = tl.load(data + e * R * DC + rows[:, None] * DC + cols[None, :], mask=mask, other=0).to(tl.int32)
        ex = (b >> 3) & 0xF
        man = (b & 7).to(tl.float32)
        normal = (1.0 + man * 0.125) * ((ex + 120) << 23).to(tl.float32, bitcast=True)  # 2^(ex - 7)
        mag = tl.where(ex == 0, man * 0.001953125, normal)  # subnormal: man * 2^-9
        mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
        q = mag * tl.where((b & 0x80) != 0, -1.0, 1.0)
        s = tl.load(scale + e * SR * SC + (rows // 128)[:, None] * SC + (cols // 128)[None, :], mask=mask, other=0.0)
        s = s.to(tl.float32)
    v = q * s
    if ROUND == 1:  # to bf16 (the scale's dtype), to nearest even, from the bits
        bits = v.to(tl.int32, bitcast=True)
        v = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    elif ROUND == 2:  # to fp16
        v = v.to(tl.float16).to(tl.float32)
    offs = a * R * C + rows[:, None] * C + cols[None, :]
    if OUT_BF16:  # stored as the bits of v rounded to nearest even (the interpreter's cast flushes subnormals)
        bits = v.to(tl.int32, bitcast=True)
        tl.store(out + offs, ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16), mask=mask)
    else:
        tl.store(out + offs, v.to(out.dtype.element_ty), mask=mask)

def dequant_experts_triton(kind: str, data: Tensor, scale: Tensor, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """`kernels.quant.dequant_experts` on the Triton path."""
    data, scale = data.contiguous(), scale.contiguous()
    pack = {"mxfp4": 2, "int4": 8, "fp8": 1}[kind]
    _, r, dc = data.shape
    c = dc * pack
    out = torch.empty(ids.numel(), r, c, dtype=dtype, device=data.device)
    if out.numel() == 0:
        return out
    raw = data.view(torch.uint8) if kind == "fp8" else data
    grid = (ids.numel(), triton.cdiv(r, BR), triton.cdiv(c, BC))
    bf16 = dtype == torch.bfloat16
    _dequant_kernel[grid](raw, scale, ids.contiguous(), out.view(torch.int16) if bf16 else out, r, c, dc,
                          scale.shape[1], scale.shape[2], KIND=_KIND[kind],
                          ROUND={torch.bfloat16: 1, torch.float16: 2}.get(scale.dtype, 0), OUT_BF16=bf16,
                          BR=BR, BC=BC)
    return out
