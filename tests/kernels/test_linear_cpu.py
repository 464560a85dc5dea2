"""The dense layers' few-row GEMM op on CPU (`kernels.linear_cpu`) against float64: within the worst-case rounding
of any fp32 summation order (|error| <= K * 2^-24 * sum |x w|), over row counts from one to MAX_ROWS, shapes with
and without a tail past the 16-float vectors, a non-contiguous input; several weights of one input in one call,
each its own call's bits; and `Linear.matmul` takes it only inside a compiled step, up to MAX_ROWS rows of fp32,
where eager forwards keep `F.linear`'s bits."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from kernels import linear_cpu
from radixk3.parallel_linear import Linear

X86 = platform.machine().lower() in ("x86_64", "amd64")
pytestmark = pytest.mark.skipif(not X86, reason="the op is built on x86 only")


def test_builds_here() -> None:
    """On x86 with a compiler (CI included) the op must build: a silent fallback would leave it untested."""
    assert linear_cpu.available()


def _within_fp32_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    want = x.double() @ w.double().T
    bound = w.shape[1] * 2.0**-24 * (x.abs().double() @ w.abs().double().T)
    return y.dtype == torch.float32 and y.shape == want.shape and bool(((y.double() - want).abs() <= bound).all())


@pytest.mark.parametrize(("m", "n", "k"), [(1, 512, 512), (2, 37, 23), (5, 130, 80), (32, 64, 16), (7, 1, 33),
                                           (13, 70, 40)])
def test_linear_is_the_matmul(m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    assert _within_fp32_rounding(linear_cpu.linear(x, w), x, w)


def test_leading_dims_and_a_strided_input() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(24, 40, generator=gen)
    x = torch.randn(2, 3, 80, generator=gen)[..., ::2]  # [2, 3, 40], not contiguous
    y = linear_cpu.linear(x, w)
    assert y.shape == (2, 3, 24) and _within_fp32_rounding(y.reshape(6, 24), x.reshape(6, 40), w)


@pytest.mark.parametrize(("m", "k"), [(1, 512), (3, 70), (8, 13), (32, 64)])
def test_linears_are_each_weights_linear_bit_for_bit(m: int, k: int) -> None:
    """One call over several weights of one input (row counts across and inside the 32-row tasks, one row, a
    weight of 130): each part is that weight's own `linear`, bit for bit (the same blocks run in one pass)."""
    gen = torch.Generator().manual_seed(m + k)
    x = torch.randn(2, m, k, generator=gen)[1]
    ws = [torch.randn(n, k, generator=gen) for n in (1, 5, 33, 130, 64)]
    parts = linear_cpu.linears(x, ws)
    assert [p.shape for p in parts] == [(m, w.shape[0]) for w in ws]
    assert all(torch.equal(p, linear_cpu.linear(x, w)) for p, w in zip(parts, ws, strict=True))
    assert all(p.is_contiguous() for p in parts)
    x3 = torch.randn(2, 3, k, generator=gen)
    assert all(torch.equal(p, linear_cpu.linear(x3, w)) for p, w in zip(linear_cpu.linears(x3, ws), ws, strict=True))
    with pytest.raises(RuntimeError, match="radixk3_gemm::linears"):
        torch.ops.radixk3_gemm.linears(x, [ws[0], torch.zeros(4, k + 1)])


def test_wrong_inputs_are_refused() -> None:
    with pytest.raises(RuntimeError, match="radixk3_gemm::linear"):
        torch.ops.radixk3_gemm.linear(torch.zeros(2, 16), torch.zeros(8, 15))
    with pytest.raises(RuntimeError, match="radixk3_gemm::linear"):
        torch.ops.radixk3_gemm.linear(torch.zeros(2, 16, dtype=torch.float64), torch.zeros(8, 16))


def test_a_compiled_linear_takes_the_op_and_eager_keeps_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """In use, a compiled few-row `Linear` runs the op (its output is the op's, bit for bit), more rows than
    MAX_ROWS run `F.linear`, and the eager call is `F.linear` bit for bit."""
    assert linear_cpu.available()
    monkeypatch.setattr(linear_cpu, "_enabled", True)
    torch.manual_seed(0)
    layer = Linear(48, 40)
    torch.nn.init.normal_(layer.weight)
    compiled = torch.compile(layer.matmul, fullgraph=True)
    few, many = torch.randn(3, 48), torch.randn(linear_cpu.MAX_ROWS + 1, 48)
    with torch.inference_mode():
        assert torch.equal(compiled(few), torch.ops.radixk3_gemm.linear(few, layer.weight))
        assert torch.equal(layer.matmul(few), F.linear(few, layer.weight))
        assert linear_cpu.applies(few, layer.weight) and not linear_cpu.applies(many, layer.weight)
        assert torch.equal(compiled(many), F.linear(many, layer.weight))
        assert not torch.equal(linear_cpu.linear(many, layer.weight), F.linear(many, layer.weight))
