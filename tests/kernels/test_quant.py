"""Dequantising packed experts (`kernels.quant`, torch and Triton) equals compressed-tensors' own decompression
bit for bit, for each format: weights compressed by the library's compressors, selected experts of a stack, model
dtypes fp32 and bf16 (int4 / fp8 scales in the weights' dtype), partial fp8 blocks, and every code and scale
exponent."""

from __future__ import annotations

import pytest
import torch

from kernels.quant import dequant_experts
from radixk3.quant_checkpoint import compress_weight, decompress_weight, expert_quant_for
from radixk3.quant_format import ExpertQuant

E, ROWS, COLS = 5, 40, 160  # 160 input columns: two fp8 blocks, the second partial; 40 rows: a partial block


def _stack(kind: str, dtype: torch.dtype, seed: int) -> tuple[ExpertQuant, list[dict[str, torch.Tensor]]]:
    quant = expert_quant_for(kind, {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype])
    gen = torch.Generator().manual_seed(seed)
    experts = []
    for e in range(E):  # scales several octaves apart, so the experts' exponents differ
        w = (torch.randn(ROWS, COLS, generator=gen) * 0.02 * 4.0**e).to(dtype)
        experts.append(compress_weight(w, quant))
    return quant, experts


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that NaNs (e8m0's 255: 0 x 2^128) need only both be NaN."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(_bits(a)[~nan], _bits(b)[~nan])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["mxfp4", "int4", "fp8"])
def test_dequant_equals_the_library(kind: str, dtype: torch.dtype, backend: str) -> None:
    quant, experts = _stack(kind, dtype, seed=len(kind))
    data = torch.stack([x[quant.data_suffix] for x in experts])
    scale = torch.stack([x["weight_scale"] for x in experts])
    assert data.dtype == quant.data_dtype and scale.dtype == quant.scale_torch_dtype
    assert tuple(data.shape[1:]), tuple(scale.shape[1:]) == quant.shapes(ROWS, COLS)
    ids = torch.tensor([1, 3, 4])
    library = [decompress_weight(experts[e], quant) for e in ids.tolist()]
    got = dequant_experts(kind, data, scale, ids, library[0].dtype)
    for i, ref in enumerate(library):
        assert torch.equal(_bits(got[i]), _bits(ref)), (kind, i)
    # Into fp32 compute: the library's values, exactly (its bf16 MXFP4 values are exact e2m1 x 2^k).
    got32 = dequant_experts(kind, data, scale, ids, torch.float32)
    for i, ref in enumerate(library):
        assert torch.equal(_bits(got32[i]), _bits(ref.float())), (kind, i)


def test_mxfp4_every_code_and_exponent(backend: str) -> None:
    quant = ExpertQuant("mxfp4", "uint8")
    codes = torch.arange(256, dtype=torch.uint8).repeat(16, 1)  # every byte: every (low, high) code pair
    exps = torch.arange(256, dtype=torch.uint8).reshape(16, 16)  # every e8m0 exponent, 16 groups a row
    ref = decompress_weight({"weight_packed": codes, "weight_scale": exps}, quant)
    got = dequant_experts("mxfp4", codes[None], exps[None], torch.tensor([0]), torch.bfloat16)[0]
    assert _same(got, ref)
    got32 = dequant_experts("mxfp4", codes[None], exps[None], torch.tensor([0]), torch.float32)[0]
    assert _same(got32, ref.float())


def test_fp8_every_code(backend: str) -> None:
    quant = ExpertQuant("fp8", "float32")
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].repeat(3, 1).view(torch.float8_e4m3fn)  # every finite e4m3fn value
    scale = torch.tensor([[0.75, 2.0**-20]])
    ref = decompress_weight({"weight": codes, "weight_scale": scale}, quant)
    got = dequant_experts("fp8", codes[None], scale[None], torch.tensor([0]), torch.float32)[0]
    assert torch.equal(_bits(got), _bits(ref))


def test_no_experts_selected(backend: str) -> None:
    quant, experts = _stack("int4", torch.float32, seed=0)
    data = torch.stack([x["weight_packed"] for x in experts])
    scale = torch.stack([x["weight_scale"] for x in experts])
    out = dequant_experts("int4", data, scale, torch.tensor([], dtype=torch.long), torch.float32)
    assert out.shape == (0, ROWS, COLS)
