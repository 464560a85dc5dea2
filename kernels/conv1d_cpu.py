"""The KDA short conv on CPU: C++/OpenMP ops (`conv1d_cpu.cpp`, built by torch's extension loader) for the three
steps that use it, each reading every input once where the torch paths make several passes over copies:
- decode (`conv1d_decode_cpu`): each sequence's pool-resident conv state read once, convolved with the new input
  and shifted in place (the torch path gathers the states, concatenates the inputs, sums the taps over the copies
  and scatters the shifted windows back);
- verify (`conv1d_verify_cpu`, without snapshots): each window position from the slot's saved inputs and the
  window's, nothing written back;
- prefill (`conv_from_history_cpu`): each token's window read in place from the history buffer the torch path
  builds (where it gathered four copies of every token's inputs, one per tap).
Each computes exactly what its torch path (`conv1d_pool.conv1d_decode`, `conv1d_verify_padded`,
`conv1d.conv_from_history`) computes before the activation, bit for bit (each tap's product rounded, the taps added
from zero, oldest first), so the torch paths stay the oracles (`tests/kernels/test_conv1d_cpu.py`). fp32 only (bf16
keeps the torch paths); x86 only, and only where a compiler builds it: elsewhere `available()` is False.
`RADIXK3_FUSED_CONV=0` keeps the torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch
from torch import Tensor

from kernels.cpu_extension import load_cpu_library

ENV_VAR = "RADIXK3_FUSED_CONV"
_SOURCE = Path(__file__).with_name("conv1d_cpu.cpp")


@functools.cache
def _library() -> ctypes.CDLL | None:
    """Build (or find cached) and load the op once per process; None where it cannot run here."""
    lib = load_cpu_library("radixk3_conv1d_cpu", _SOURCE, ["-ffp-contract=off"])
    if lib is None:
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.radixk3_conv_decode.restype = None
    lib.radixk3_conv_decode.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, ptr, ptr]
    lib.radixk3_conv_verify.restype = None
    lib.radixk3_conv_verify.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, ptr]
    lib.radixk3_conv_prefill.restype = None
    lib.radixk3_conv_prefill.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr]
    return lib


def available() -> bool:
    """Whether `conv1d_cpu` runs here (built on the first call; `RADIXK3_FUSED_CONV=0` turns it off)."""
    return os.environ.get(ENV_VAR, "1").strip() != "0" and _library() is not None


def fusable(x: Tensor, pool: Tensor) -> bool:
    """Inputs the op takes: fp32 on CPU, each slot's [C, W-1] states contiguous (the slot stride is free)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and pool_fusable(pool)


def pool_fusable(pool: Tensor) -> bool:
    """A conv pool the op takes: fp32 on CPU, each slot's [C, W-1] states contiguous."""
    keep = pool.shape[-1]
    return (pool.device.type == "cpu" and pool.dtype == torch.float32 and pool.stride(-1) == 1
            and pool.stride(-2) == keep)


def conv1d_cpu(x: Tensor, weight: Tensor, pool: Tensor, slots: Tensor) -> Tensor:
    """One token per sequence, x [N, C], weight [C, W]: each slot's conv state `pool` [slots, C, W-1] shifted by
    its token in place -> y [N, C] fp32 before the activation. Slots in range (checked by the caller)."""
    return conv1d_cpu_prepared(x.contiguous(), weight.float().contiguous(), pool, slots.to(torch.int64).contiguous())


def conv1d_cpu_prepared(x: Tensor, weight: Tensor, pool: Tensor, slots: Tensor) -> Tensor:
    """`conv1d_cpu` on inputs already in the op's layout (x, weight contiguous fp32, slots contiguous int64), as a
    captured step holds them: no per-call conversions (each a few microseconds in a cold interpreter)."""
    lib = _library()
    assert lib is not None, "call available() and fusable() first"  # conv1d_pool checked both, once per call
    n, c = x.shape
    y = torch.empty(n, c, dtype=torch.float32)
    lib.radixk3_conv_decode(pool.data_ptr(), pool.stride(0), slots.data_ptr(), n, c, weight.shape[-1], x.data_ptr(),
                            weight.data_ptr(), y.data_ptr())
    return y


def conv1d_verify_cpu(x: Tensor, weight: Tensor, pool: Tensor, slots: Tensor) -> Tensor:
    """Speculative windows x [N, L, C] (zero-padded), weight [C, W]: each position convolved from its slot's conv
    state `pool` [slots, C, W-1] and the window's inputs before it, nothing written back -> y [N, L, C] fp32
    before the activation, bit for bit `conv1d_pool.conv1d_verify_padded`'s."""
    lib = _library()
    assert lib is not None, "call available() and fusable() first"
    n, length, c = x.shape
    x, w = x.contiguous(), weight.float().contiguous()
    slots = slots.to(torch.int64).contiguous()
    y = torch.empty(n, length, c, dtype=torch.float32)
    lib.radixk3_conv_verify(pool.data_ptr(), pool.stride(0), slots.data_ptr(), n, length, c, w.shape[-1],
                            x.data_ptr(), w.data_ptr(), y.data_ptr())
    return y


def conv_from_history_cpu(hist: Tensor, row: Tensor, weight: Tensor) -> Tensor:
    """`conv1d.conv_from_history` before the activation: hist [R, C] (fp32, a `conv_history` buffer), the rows of
    the tokens `row` [T], weight [C, W] -> y [T, C] fp32, each token's window read in place, bit for bit."""
    lib = _library()
    assert lib is not None, "call available() first"
    hist, w = hist.contiguous(), weight.float().contiguous()
    row = row.to(torch.int64).contiguous()
    y = torch.empty(row.shape[0], hist.shape[1], dtype=torch.float32)
    lib.radixk3_conv_prefill(hist.data_ptr(), row.data_ptr(), row.shape[0], hist.shape[1], w.shape[-1],
                             w.data_ptr(), y.data_ptr())
    return y
