"""The routed experts' GEMMs of a compiled decode step on CPU: a C++/OpenMP op (`moe_gemm_cpu.cpp`, built by
torch's extension loader) for token rows grouped by expert with few rows per expert, as in every decode step. It
streams each chosen expert's weights once and multiplies each weight row by all of the expert's rows while it is
in registers; a GEMM call per expert (the torch path) pays its packing and call costs 2 x E times a layer (k3-small
fp32, the compiled step: 33.9 -> 31.9 ms at batch 32, 19.9 -> 19.2 at batch 8).

Not bit for bit the GEMM library's sums (its order is its own), so it serves the compiled decode steps only
(`moe.routed_experts`), where the eager step is the oracle by greedy tokens (`tests/runtime/test_decode_graph.py`);
its own oracle is float64 within the worst-case rounding of an fp32 dot product (`tests/kernels/test_moe_gemm_cpu.py`).
fp32 on x86 only, and only where a compiler builds it; `RADIXK3_FUSED_MOE=0` keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import os
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
    return lib


def available() -> bool:
    """Whether `grouped_gemm` runs here (built on the first call; `RADIXK3_FUSED_MOE=0` turns it off)."""
    return os.environ.get(ENV_VAR, "1").strip() != "0" and _library() is not None


def fusable(x: Tensor, *weights: Tensor) -> bool:
    """fp32 activations and contiguous fp32 expert weights on CPU."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and all(
        w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous() for w in weights)


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
