"""The dense layers' GEMMs of a compiled decode step on CPU: a torch op registered in C++ (`linear_cpu.cpp`, built
by torch's extension loader) over skinny_gemm.h's few-row kernel, which the routed experts use too.

Why: a decode step multiplies each weight by a handful of rows, so reading the weight is the whole cost, and the
GEMM library (MKL through `F.linear`) read k3-small's 60 MB of dense weights at 10 GB/s for one row (5.9 ms),
this kernel at 25 GB/s (2.4 ms; `bench/linear_gemm.py` measures both, `bench/compiled_steps.py` the steps).

Not the GEMM library's bits (its summation order is its own), so, as the routed experts' op, it serves the compiled
steps only (`radixk3.parallel_linear.Linear.matmul` while a step is being compiled, up to MAX_ROWS rows), where
the eager step is the oracle by greedy tokens (`tests/runtime/test_decode_graph.py`); its own oracle is float64
within the worst-case rounding of an fp32 dot product (`tests/kernels/test_linear_cpu.py`). fp32 on x86 only, and
only where a compiler builds it; `RADIXK3_FUSED_LINEAR=0` (read when captured steps are built) keeps `F.linear`.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
from torch import Tensor

from kernels.cpu_extension import load_torch_ops

ENV_VAR = "RADIXK3_FUSED_LINEAR"
_SOURCE = Path(__file__).with_name("linear_cpu.cpp")
# Rows (tokens) up to which the kernel serves a layer: decode and verify steps of up to 32 rows, where it read the
# dense weights faster than MKL here (`bench/linear_gemm.py`); from about 64 rows a GEMM library's blocking wins.
MAX_ROWS = 32

# True only while a captured step that takes the op is compiled or replayed (`use`): the compiler reads it as a
# constant and guards on it, so steps captured with and without the op each find their own graph.
_enabled = False


@functools.cache
def _loaded() -> bool:
    """Build (or find cached) and load the op once per process, and register its fake (shape) function."""
    if not load_torch_ops("radixk3_linear_cpu", _SOURCE, []):
        return False

    @torch.library.register_fake("radixk3_gemm::linear")
    def _(x: Tensor, weight: Tensor) -> Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("radixk3_gemm::linears")
    def _(x: Tensor, weights: list[Tensor]) -> Tensor:
        return x.new_empty(x.shape[0], sum(w.shape[0] for w in weights))

    return True


def available() -> bool:
    """Whether the op runs here (built on the first call; `RADIXK3_FUSED_LINEAR=0` turns it off)."""
    return os.environ.get(ENV_VAR, "1").strip() != "0" and _loaded()


def use(on: bool) -> bool:
    """Whether compiled `Linear` layers take the op from now on (a captured step's replay sets it around its
    call; `on` only where `available()`); returns the previous setting, to restore. One switch per process: a
    worker replays its steps from one thread (two threads replaying steps of both settings at once would make each
    other's graphs fail their guards and compile again)."""
    global _enabled
    before, _enabled = _enabled, on
    return before


def enabled() -> bool:
    """Whether compiled `Linear` layers take the op now (`use`)."""
    return _enabled


def applies(x: Tensor, weight: Tensor) -> bool:
    """Whether `linear` serves x @ weight.T: enabled, fp32 on CPU, a contiguous weight, at most MAX_ROWS rows."""
    return (_enabled and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.is_contiguous() and x.shape[-1] > 0 and x.numel() <= MAX_ROWS * x.shape[-1])


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [..., K] @ weight [N, K].T -> [..., N] fp32 (`F.linear` without bias, within fp32 rounding)."""
    y = torch.ops.radixk3_gemm.linear(x.reshape(-1, x.shape[-1]), weight)
    return y.view(*x.shape[:-1], weight.shape[0])


def linears(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    """x [..., K] @ each weight [N_i, K].T -> [..., N_i] fp32, in one call (each output `linear`'s bits): a decode
    step's projections of one input spare the fixed costs of a call each."""
    y = torch.ops.radixk3_gemm.linears(x.reshape(-1, x.shape[-1]), weights)
    parts = y.split([w.shape[0] for w in weights], dim=-1)  # (contiguous already where x is one row)
    return [part.contiguous().view(*x.shape[:-1], part.shape[-1]) for part in parts]
