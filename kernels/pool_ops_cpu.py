"""The captured steps' pool ops on CPU as torch ops registered in C++ (`pool_ops_cpu.cpp`): short conv, KDA and
MLA store + attention of the decode step, and the verify step's window ops (short conv and KDA from the live
state, their inputs saved in the draft window's rings for ReplaySSM), each reaching its pool (and ring) through a
C++ registry by cache key; and ReplaySSM's commit after acceptance (`window_commit`: every KDA layer's replay in one
call, where the torch path makes ~15 small calls a layer per committed token).

Why: a decode step streams its ~100 MB of weights between the pool ops' calls, so each op's Python body (a dict
lookup, a switch, ~10 small ATen calls, the ctypes call) runs in an interpreter whose code and data were evicted:
~40-300 us a call at batch 1, 14 calls a k3-small step. Here the inductor wrapper's one call goes straight to C++.

Exactness: each op calls the same C++ kernel as the ctypes path (`conv1d_cpu`, `kda_decode_cpu`, `mla_decode_cpu`:
their functions' addresses are handed over, so it is the same machine code) and does the work around it with the
ATen ops the Python bodies call, in the same order (the KDA decay's `exp` stays ATen's: an inductor or C++ `exp`
differs in the last bit). `tests/kernels/test_pool_ops_cpu.py` holds each to the Python op, bit for bit.

Built once per machine (about seven seconds; torch caches it); `available()` is False where any of the three
kernels or this library cannot be built, or `RADIXK3_FUSED_POOL_OPS=0`: the Python ops serve.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from kernels import conv1d_cpu, kda_decode_cpu, mla_decode_cpu
from kernels.cpu_extension import load_torch_ops

ENV_VAR = "RADIXK3_FUSED_POOL_OPS"
_SOURCE = Path(__file__).with_name("pool_ops_cpu.cpp")


def _address(fn: object) -> int:
    return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)


@functools.cache
def _loaded() -> bool:
    """Build (or find cached) and load the ops once per process, hand them the kernels, register their fakes."""
    libs = (conv1d_cpu._library(), kda_decode_cpu._library(), mla_decode_cpu._library())
    if any(lib is None for lib in libs) or not load_torch_ops("radixk3_pool_ops_cpu", _SOURCE, []):
        return False
    conv, kda, mla = libs
    assert conv is not None and kda is not None and mla is not None
    torch.ops.radixk3_cpu.set_kernels(_address(conv.radixk3_conv_decode), _address(kda.radixk3_kda_decode),
                                      _address(mla.radixk3_mla_decode), _address(conv.radixk3_conv_verify),
                                      _address(kda.radixk3_kda_verify), _address(kda.radixk3_kda_replay))
    _register_fakes()
    return True


def available() -> bool:
    """Whether the ops run here (built on the first call; `RADIXK3_FUSED_POOL_OPS=0` turns them off)."""
    return os.environ.get(ENV_VAR, "1").strip() != "0" and _loaded()


def register_pools(key: int, conv: Sequence[Tensor], recurrent: Sequence[Tensor], latent: Sequence[Tensor]) -> None:
    """Make cache `key`'s pools (one tensor per layer of each kind) reachable by the ops; held until
    `unregister_pools(key)`."""
    torch.ops.radixk3_cpu.register_pools(key, list(conv), list(recurrent), list(latent))


def register_window(key: int, x: Sequence[Tensor], k: Sequence[Tensor], v: Sequence[Tensor], g: Sequence[Tensor],
                    beta: Sequence[Tensor]) -> None:
    """Make a draft window's per-token input rings (`SpecWindow`, replay mode; one tensor per KDA layer each)
    reachable by the verify ops of cache `key` (registered first)."""
    torch.ops.radixk3_cpu.register_window(key, list(x), list(k), list(v), list(g), list(beta))


def unregister_pools(key: int) -> None:
    torch.ops.radixk3_cpu.unregister_pools(key)


# Python's calls, the ops' schemas (what the captured step sees): each returns a new contiguous fp32 tensor.
def conv_decode(key: int, layer: int, x: Tensor, weight: Tensor, slots: Tensor) -> Tensor:
    """SiLU(`conv1d_cpu.conv1d_cpu_prepared`) on cache `key`'s conv pool of KDA layer `layer`, in place."""
    return torch.ops.radixk3_cpu.conv_decode(key, layer, x, weight, slots)


def kda_decode(key: int, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
               slots: Tensor) -> Tensor:
    """`kda_decode_cpu.kda_decode_cpu` (scale K ** -0.5) on cache `key`'s recurrent pool of KDA layer `layer`."""
    return torch.ops.radixk3_cpu.kda_decode(key, layer, q, k, v, g, beta, slots)


def mla_decode(key: int, layer: int, q_nope: Tensor, q_pe: Tensor, latent: Tensor, kv_b_weight: Tensor,
               kv_slots: Tensor, kv_rows: Tensor, kv_lens: Tensor, scale: float) -> Tensor:
    """Store `latent` at `kv_slots` of cache `key`'s MLA layer `layer`, then `mla.mla_decode_padded_cpu`."""
    return torch.ops.radixk3_cpu.mla_decode(key, layer, q_nope, q_pe, latent, kv_b_weight, kv_slots, kv_rows,
                                            kv_lens, scale)


def conv_verify(key: int, layer: int, x: Tensor, weight: Tensor, slots: Tensor, rows: Tensor) -> Tensor:
    """Windows x [B, W, C]: saved in the draft window's rows `rows`, then SiLU(`conv1d_cpu.conv1d_verify_cpu`) from
    cache `key`'s live conv states (not written back)."""
    return torch.ops.radixk3_cpu.conv_verify(key, layer, x, weight, slots, rows)


def kda_verify(key: int, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, slots: Tensor,
               rows: Tensor) -> Tensor:
    """Windows [B, W, ...]: k, v, g, beta saved in the draft window's rows `rows`, then
    `kda_decode_cpu.kda_verify_cpu` (no snapshots) from cache `key`'s live states (not written back)."""
    return torch.ops.radixk3_cpu.kda_verify(key, layer, q, k, v, g, beta, slots, rows)


def window_commit(key: int, slots: Tensor, rows: Tensor, num_tokens: Tensor) -> None:
    """`SpecWindow.commit` in replay mode on cache `key`'s pools and its registered draft window: each sequence's
    live KDA states (slot slots[i]) advanced over the first num_tokens[i] (>= 1) inputs saved in window row
    rows[i], every layer in one call, bit for bit `kda_pool.kda_replay` and `conv1d_pool.conv1d_replay`."""
    torch.ops.radixk3_cpu.window_commit(key, slots, rows, num_tokens)


def _register_fakes() -> None:
    @torch.library.register_fake("radixk3_cpu::conv_decode")
    def _(key: int, layer: int, x: Tensor, weight: Tensor, slots: Tensor) -> Tensor:
        return torch.empty_like(x, dtype=torch.float32, memory_format=torch.contiguous_format)

    @torch.library.register_fake("radixk3_cpu::kda_decode")
    def _(key: int, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, slots: Tensor) -> Tensor:
        return torch.empty_like(v, dtype=torch.float32, memory_format=torch.contiguous_format)

    @torch.library.register_fake("radixk3_cpu::mla_decode")
    def _(key: int, layer: int, q_nope: Tensor, q_pe: Tensor, latent: Tensor, kv_b_weight: Tensor,
          kv_slots: Tensor, kv_rows: Tensor, kv_lens: Tensor, scale: float) -> Tensor:
        n, h, dn = q_nope.shape
        return q_nope.new_empty(n, h, kv_b_weight.shape[0] // h - dn, dtype=torch.float32)

    @torch.library.register_fake("radixk3_cpu::conv_verify")
    def _(key: int, layer: int, x: Tensor, weight: Tensor, slots: Tensor, rows: Tensor) -> Tensor:
        return torch.empty_like(x, dtype=torch.float32, memory_format=torch.contiguous_format)

    @torch.library.register_fake("radixk3_cpu::kda_verify")
    def _(key: int, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, slots: Tensor,
          rows: Tensor) -> Tensor:
        return torch.empty_like(v, dtype=torch.float32, memory_format=torch.contiguous_format)
