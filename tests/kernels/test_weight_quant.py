"""Weight-only int8 / int4 (kernels.weight_quant): torch's CPU kernels against the dequantise-then-matmul
reference (fp32: within fp32 accumulation-order error; bf16: within one bf16 rounding of the output), the codes
within half a step of the weight, a column shard quantised with its row's whole amax equal to the whole weight's
codes, and each row's result independent of the rows batched with it (bit for bit)."""

from __future__ import annotations

import pytest
import torch

from kernels.weight_quant import (
    dequant_int4,
    dequant_int8,
    int4_mm,
    int8_mm,
    pack_int4,
    quantize_int4,
    quantize_int8,
    reference_mm,
    row_amax,
)

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-7, atol=2**-6)}


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) / k**0.5


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_kernel_equals_the_dequantised_matmul(dtype: torch.dtype) -> None:
    w = quantize_int8(_weight(48, 96, 0).to(dtype))
    assert w.q.dtype == torch.int8 and w.scales.dtype == dtype
    x = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = int8_mm(x, w)
    assert y.shape == (2, 5, 48) and y.dtype == dtype
    torch.testing.assert_close(y, reference_mm(x, dequant_int8(w)), **TOL[dtype])


@pytest.mark.parametrize("rows", [64, 20])  # 20: padded to 32 rows for the packing, the padding cut off
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_kernel_equals_the_dequantised_matmul(dtype: torch.dtype, rows: int) -> None:
    codes = quantize_int4(_weight(rows, 128, 2).to(dtype))
    assert int(codes.q.min()) >= 0 and int(codes.q.max()) <= 15 and codes.scales_zeros.shape == (4, rows, 2)
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(3)).to(dtype)
    y = int4_mm(x, pack_int4(codes))
    assert y.shape == (7, rows) and y.dtype == dtype
    torch.testing.assert_close(y, reference_mm(x, dequant_int4(codes)), **TOL[dtype])


def test_codes_are_within_half_a_step_of_the_weight() -> None:
    w = _weight(32, 64, 4)
    q8 = quantize_int8(w)
    assert (dequant_int8(q8) - w).abs().le(q8.scales[:, None] / 2 + 1e-7).all()
    assert q8.q.abs().amax(1).eq(127).all()  # each row's largest weight takes the largest code
    c4 = quantize_int4(w)
    step = c4.scales_zeros[..., 0].t().repeat_interleave(32, dim=1)  # [N, K] the scale of each weight's group
    assert (dequant_int4(c4) - w).abs().le(step / 2 + 1e-6).all()


def test_a_column_shard_with_the_whole_rows_amax_quantises_as_the_whole() -> None:
    """What a row-parallel shard does (its rows' amax all-reduced over the group): the same codes and scales."""
    w = _weight(16, 64, 5)
    whole = quantize_int8(w)
    amax = row_amax(w)
    for cols in (slice(0, 32), slice(32, 64)):
        part = quantize_int8(w[:, cols], amax)
        assert torch.equal(part.q, whole.q[:, cols]) and torch.equal(part.scales, whole.scales)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_each_rows_result_does_not_depend_on_its_batch(method: str, dtype: torch.dtype) -> None:
    """A decode row alone, in a batch of 3 or 40, at any offset: the same bits (batch composition never changes a
    sequence's logits through these GEMMs)."""
    w = _weight(64, 256, 6).to(dtype)
    if method == "int8":
        q8 = quantize_int8(w)

        def mm(x: torch.Tensor) -> torch.Tensor:
            return int8_mm(x, q8)
    else:
        q4 = pack_int4(quantize_int4(w))

        def mm(x: torch.Tensor) -> torch.Tensor:
            return int4_mm(x, q4)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(7)).to(dtype)
    full = mm(x)
    for rows in (slice(0, 1), slice(17, 18), slice(0, 3), slice(5, 8), slice(3, 40)):
        assert torch.equal(mm(x[rows]), full[rows]), rows
