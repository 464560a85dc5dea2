"""The middle of MLA's absorbed decode on CPU as one C++/OpenMP op (`mla_decode_cpu.cpp`): per query row and head,
scores against its cached latents read in place from the pool, a softmax over its own length and the weighted sum
of the latents. The torch path (`mla.mla_decode_padded`) gathers a copy of every row's S latents (padding
included) and runs four batched matmuls of a few rows each, whose fixed costs dominate a small model's step.

fp32 only (a bf16 step keeps the torch path, whose bf16 roundings the eager step shares). It differs from the
torch path in the last bits (its sums run in another order): `tests/kernels/test_mla_decode_cpu.py` holds it to
the torch path within a stated tolerance. `RADIXK3_FUSED_MLA=0` keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch
from torch import Tensor

from kernels.cpu_extension import load_cpu_library

ENV_VAR = "RADIXK3_FUSED_MLA"
_SOURCE = Path(__file__).with_name("mla_decode_cpu.cpp")


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = load_cpu_library("radixk3_mla_decode_cpu", _SOURCE, ["-fno-math-errno"])  # glibc's vector expf
    if lib is None:
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.radixk3_mla_decode.restype = None
    lib.radixk3_mla_decode.argtypes = [ptr, ptr, i64, ptr, ptr, *[i64] * 5, ctypes.c_float, ptr]
    return lib


def available() -> bool:
    """Whether the op runs here (built on the first call; `RADIXK3_FUSED_MLA=0` turns it off)."""
    return os.environ.get(ENV_VAR, "1").strip() != "0" and _library() is not None


def fusable(q: Tensor, latent: Tensor) -> bool:
    """fp32 queries and pool on CPU, each latent row contiguous (the row stride is free)."""
    return (q.device.type == "cpu" and latent.device.type == "cpu" and q.dtype == torch.float32
            and latent.dtype == torch.float32 and latent.stride(-1) == 1)


def mla_decode_latent_cpu(q: Tensor, latent: Tensor, kv_rows: Tensor, kv_lens: Tensor, r: int,
                          scale: float) -> Tensor:
    """q [N, H, E] (absorbed queries), latent [L, E] (the pool), kv_rows [N, S] (row i's first kv_lens[i] entries
    its cached rows) -> [N, H, r]: sum over row i's rows of softmax(q . latent * scale) * latent[:, :r]."""
    n, h, e = q.shape
    if latent.shape[-1] != e or not 0 < r <= e or kv_rows.shape[0] != n or kv_lens.shape != (n,):
        raise ValueError(f"MLA decode shapes: q {tuple(q.shape)}, latent {tuple(latent.shape)}, r {r}, "
                         f"kv_rows {tuple(kv_rows.shape)}, kv_lens {tuple(kv_lens.shape)}")
    return mla_decode_latent_cpu_prepared(q.contiguous(), latent, kv_rows.to(torch.int64).contiguous(),
                                          kv_lens.to(torch.int64).contiguous(), r, scale)


def mla_decode_latent_cpu_prepared(q: Tensor, latent: Tensor, rows: Tensor, lens: Tensor, r: int,
                                   scale: float) -> Tensor:
    """`mla_decode_latent_cpu` on inputs already checked and in the op's layout (q contiguous, rows and lens
    contiguous int64), as a captured step holds them: no per-call checks or conversions."""
    lib = _library()
    assert lib is not None, "call available() and fusable() first"
    n, h, e = q.shape
    out = torch.empty(n, h, r, dtype=torch.float32)
    lib.radixk3_mla_decode(q.data_ptr(), latent.data_ptr(), latent.stride(0), rows.data_ptr(), lens.data_ptr(),
                           n, h, e, r, rows.shape[1], scale, out.data_ptr())
    return out
