"""The routed experts' GEMMs of a compiled decode step on CPU: a C++/OpenMP op (`moe_gemm_cpu.cpp`, built by
torch's extension loader) for token rows grouped by expert with few rows per expert, as in every decode step. It
streams each chosen expert's weights once and multiplies each weight row by all of the expert's rows while it is
in registers; a GEMM call per expert (the torch path) pays its packing and call costs 2 x E times a layer (k3-small
fp32, the compiled step: 33.9 -> 31.9 ms at batch 32, 19.9 -> 19.2 at batch 8). `routed_experts_cpu` runs the whole
routed half of a step's MoE through it in two library calls (grouping by expert, the gather, both GEMMs, the sum of
each token's pairs; the activation between them is torch's): 1.2 ms less a batch-32 step than the thirty-odd torch
op calls it replaces, each slow in an interpreter that the step's weight reads keep evicting.

Not bit for bit the GEMM library's sums (its order is its own), so it serves the compiled decode steps only
(`moe.routed_experts`), where the eager step is the oracle by greedy tokens (`tests/runtime/test_decode_graph.py`);
its own oracle is float64 within the worst-case rounding of an fp32 dot product (`tests/kernels/test_moe_gemm_cpu.py`).
fp32 on x86 only, and only where a compiler builds it; `RADIXK3_FUSED_MOE=0` keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from kernels.cpu_extension import load_cpu_library

ENV_VAR = "RADIXK3_FUSED_MOE"
_SOURCE = Path(__file__).with_name("moe_gemm_cpu.cpp")
# Above this many rows for one expert a GEMM library's blocking wins (prefill, large batches).
MAX_ROWS_PER_EXPERT = 32


@functools.cache
def _library() -> ctypes.CDLL | None:
    """Build (or find cached) and load the op once per process; None where it cannot run here."""
    lib = load_cpu_library("radixk3_moe_gemm_cpu", _SOURCE, [])
    if lib is None:
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.radixk3_grouped_gemm.restype = None
    lib.radixk3_grouped_gemm.argtypes = [ptr, ptr, i64, ptr, i64, i64, ptr]
    lib.radixk3_moe_up.restype = i64
    lib.radixk3_moe_up.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr]
    lib.radixk3_moe_down.restype = None
    lib.radixk3_moe_down.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr]
    return lib


def available() -> bool:
    """Whether `grouped_gemm` runs here (built on the first call; `RADIXK3_FUSED_MOE=0` turns it off)."""
    return os.environ.get(ENV_VAR, "1").strip() != "0" and _library() is not None


def fusable(x: Tensor, *weights: Tensor) -> bool:
    """fp32 activations and contiguous fp32 expert weights on CPU."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and all(
        w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous() for w in weights)


def routed_experts_cpu(x: Tensor, experts: Tensor, weights: Tensor, w13: Tensor, w2: Tensor,
                       act: Callable[[Tensor, Tensor], Tensor]) -> Tensor | None:
    """The routed experts of a decode step, x [T, D] fp32, experts / weights [T, k]: the pairs grouped by expert,
    both GEMMs (this op) with `act` between them (torch's), and each token's pairs summed in expert order, as
    `moe._grouped_by` does, in two calls to the library where the torch path makes some thirty op calls (a few
    microseconds each in the interpreter a step's weight reads keep evicting). None if an expert has more than
    MAX_ROWS_PER_EXPERT rows (nothing computed)."""
    lib = _library()
    assert lib is not None, "call available() and fusable() first"
    t, d = x.shape
    e, n2, _ = w13.shape
    k, inter = experts.shape[1], w2.shape[-1]
    x, experts = x.contiguous(), experts.to(torch.int64).contiguous()
    order, counts = torch.empty(t * k, dtype=torch.int64), torch.empty(e, dtype=torch.int64)
    gu = torch.empty(t * k, n2, dtype=torch.float32)
    most = lib.radixk3_moe_up(x.data_ptr(), t, d, experts.data_ptr(), k, e, w13.data_ptr(), n2, MAX_ROWS_PER_EXPERT,
                              order.data_ptr(), counts.data_ptr(), gu.data_ptr())
    if most > MAX_ROWS_PER_EXPERT:
        return None
    h = act(gu[:, :inter], gu[:, inter:]).contiguous()
    weights = weights.float().contiguous()
    out = torch.empty(t, d, dtype=torch.float32)
    lib.radixk3_moe_down(h.data_ptr(), order.data_ptr(), counts.data_ptr(), t, k, e, w2.data_ptr(), d, inter,
                         weights.data_ptr(), out.data_ptr())
    return out


def grouped_gemm(x: Tensor, counts: Tensor, w: Tensor) -> Tensor:
    """x [P, K] rows grouped by expert (counts [E]: rows per expert, in expert order), w [E, N, K] ->
    y [P, N] fp32, y[p] = w[expert of p] @ x[p]."""
    lib = _library()
    assert lib is not None, "call available() and fusable() first"
    e, n, k = w.shape
    x = x.float().contiguous()
    counts = counts.to(torch.int64).contiguous()
    if x.shape != (int(counts.sum()), k) or counts.shape != (e,):
        raise ValueError(f"grouped_gemm: x {tuple(x.shape)}, counts {tuple(counts.shape)}, w {tuple(w.shape)}")
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    lib.radixk3_grouped_gemm(x.data_ptr(), counts.data_ptr(), e, w.data_ptr(), n, k, y.data_ptr())
    return y
