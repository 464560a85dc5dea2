"""The KDA decode step fused in place on CPU: a C++/OpenMP op (`kda_decode_cpu.cpp`, built by torch's extension
loader) that reads each sequence's pool-resident state once, decays and updates it in cache, writes it back once
and reads the output from it, where the torch path gathers the states, makes five passes over copies of them and
scatters them back. A verify window runs the same step over its positions from an in-cache copy of each state.

Both compute exactly what the torch paths of `kda_pool.kda_decode` and `kda_verify_padded` compute, bit for bit
(the same fp32 roundings in the same order: see the C++ file), so decode stays bit-identical to replay (torch) and
the torch paths stay the oracle (`tests/kernels/test_kda_decode_cpu.py`). torch's sum order depends on its float
vector width, known here for x86 only: elsewhere, or without a compiler, `available()` is False and the torch
paths run.

Built once per machine on first use (about two seconds; torch caches the library under its extensions directory
and rebuilds when the source changes). `RADIXK3_FUSED_KDA=0` keeps the torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch
from torch import Tensor

from kernels.cpu_extension import load_cpu_library

ENV_VAR = "RADIXK3_FUSED_KDA"
_SOURCE = Path(__file__).with_name("kda_decode_cpu.cpp")
# The floats per vector of torch's CPU sum kernel on x86, whatever the capability: it is dispatched to its AVX2
# build on AVX512 machines too (checked bit for bit by the tests).
_SUM_LANES = 8


@functools.cache
def _library() -> ctypes.CDLL | None:
    """Build (or find cached) and load the op once per process; None where it cannot run here."""
    lib = load_cpu_library("radixk3_kda_decode_cpu", _SOURCE, ["-ffp-contract=off"])
    if lib is None:
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.radixk3_kda_decode.restype = None
    lib.radixk3_kda_decode.argtypes = [ptr, i64, ptr, *[i64] * 4, *[ptr] * 6, i64]
    lib.radixk3_kda_verify.restype = None
    lib.radixk3_kda_verify.argtypes = [ptr, i64, ptr, *[i64] * 5, *[ptr] * 7, i64, i64, ptr, i64]
    lib.radixk3_kda_replay.restype = None  # called from C++ only (`pool_ops_cpu.window_commit`)
    lib.radixk3_kda_replay.argtypes = [ptr, i64, ptr, *[i64] * 5, *[ptr] * 5, i64]
    return lib


def available() -> bool:
    """Whether `kda_decode_cpu` runs here (built on the first call; `RADIXK3_FUSED_KDA=0` turns it off)."""
    return os.environ.get(ENV_VAR, "1").strip() != "0" and _library() is not None


def fusable(pool: Tensor, slots: Tensor) -> bool:
    """A pool the op takes (`pool_fusable`), slots on CPU."""
    return slots.device.type == "cpu" and pool_fusable(pool)


def pool_fusable(t: Tensor) -> bool:
    """States the op takes (a pool, or verify snapshots): fp32 on CPU, each [H, K, V] state (the last three dims)
    contiguous; the strides before them are free."""
    h, kdim, vdim = t.shape[-3:]
    return (t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 and t.stride(-2) == vdim
            and t.stride(-3) == kdim * vdim)


def _factors(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float) -> list[Tensor]:
    """The torch step's own per-token factors, contiguous fp32: exp(g), k, beta k, v, q scale."""
    kf = k.float()
    return [x.contiguous() for x in (g.float().exp(), kf, beta.float()[..., None] * kf, v.float(), q.float() * scale)]


def kda_decode_cpu(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor, slots: Tensor,
                   scale: float) -> Tensor:
    """The torch decode step (q, k, g [N, H, K] prepared, v [N, H, V], beta [N, H]) on `pool` [slots, H, K, V]
    in place (slots distinct, checked by the caller) -> o [N, H, V] fp32. The small per-token factors are the
    torch path's own expressions; the op does the state work."""
    lib = _library()
    assert lib is not None, "call available() and fusable() first"  # kda_pool checked both, once per call
    n, h, kdim = k.shape
    vdim = pool.shape[-1]
    slots = slots.to(torch.int64).contiguous()
    out = torch.empty(n, h, vdim, dtype=torch.float32)
    factors = _factors(q, k, v, g, beta, scale)  # held until the call returns: the op reads their memory
    lib.radixk3_kda_decode(pool.data_ptr(), pool.stride(0), slots.data_ptr(), n, h, kdim, vdim,
                           *(x.data_ptr() for x in factors), out.data_ptr(), _SUM_LANES)
    return out


def verify_fusable(pool: Tensor, slots: Tensor, snapshots: Tensor | None) -> bool:
    """A verify window the op takes: `fusable` pool and snapshots [R, W, H, K, V] with contiguous states."""
    return fusable(pool, slots) and (snapshots is None or pool_fusable(snapshots))


def kda_verify_cpu(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor, slots: Tensor,
                   scale: float, snapshots: Tensor | None, snapshot_rows: Tensor | None) -> Tensor:
    """`kda_pool.kda_verify_padded`'s torch loop (q, k, g [N, W, H, K], v [N, W, H, V], beta [N, W, H]) from each
    slot's state, not written back; the state after position t to snapshots[snapshot_rows[i], t] when given.
    -> o [N, W, H, V] fp32, bit for bit the torch loop's."""
    lib = _library()
    assert lib is not None, "call available() and verify_fusable() first"  # kda_pool checked both
    n, w, h, kdim = k.shape
    vdim = pool.shape[-1]
    slots = slots.to(torch.int64).contiguous()
    out = torch.empty(n, w, h, vdim, dtype=torch.float32)
    snap, snap_strides, rows = None, (0, 0), None
    if snapshots is not None and snapshot_rows is not None:
        snap, snap_strides = snapshots.data_ptr(), (snapshots.stride(0), snapshots.stride(1))
        rows = snapshot_rows.to(torch.int64).contiguous()
    factors = _factors(q, k, v, g, beta, scale)
    lib.radixk3_kda_verify(pool.data_ptr(), pool.stride(0), slots.data_ptr(), n, w, h, kdim, vdim,
                           *(x.data_ptr() for x in factors), out.data_ptr(), snap,
                           *snap_strides, None if rows is None else rows.data_ptr(), _SUM_LANES)
    return out
