"""Launch Triton kernels on CUDA tensors compiled, and on CPU tensors under Triton's interpreter.

`triton.jit` picks compiled or interpreted once, at decoration time, from TRITON_INTERPRET. The runtime and the
tests need both in one process (torch on CPU, Triton forced on CPU tensors for testing, Triton compiled on a
GPU), so kernels here are wrapped once by `kernel` and pick per launch from where their tensors live.
Triton's own library functions (tl.sum, tl.zeros, tl.cumsum, ...) are @jit functions too: for an
interpreted launch they are swapped for interpreted twins and restored afterwards. Kernels written for this
wrapper call no @triton.jit helpers of their own (those would be bound to one mode).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from types import ModuleType
from typing import Any

import torch
import triton
import triton.experimental.gluon  # noqa: F401  (imported lazily by a launch, it must see the compiled library)
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

Grid = Sequence[int] | Callable[[dict[str, Any]], Sequence[int]]


@cache
def _library_twins() -> list[tuple[ModuleType, str, Any, Any]]:
    """(module, name, compiled function, interpreted twin) for the @jit functions of triton.language."""
    twins: dict[int, Any] = {}
    out: list[tuple[ModuleType, str, Any, Any]] = []
    for mod in (tl, tl.standard, tl.math):
        for name, val in list(vars(mod).items()):
            if isinstance(val, JITFunction):
                twin = twins.setdefault(id(val), InterpretedFunction(val.fn))
                out.append((mod, name, val, twin))
    return out


@contextmanager
def _interpreted_library() -> Iterator[None]:
    twins = _library_twins()
    for mod, name, _, twin in twins:
        setattr(mod, name, twin)
    try:
        yield
    finally:
        for mod, name, val, _ in twins:
            setattr(mod, name, val)


class Kernel:
    """A Triton kernel launched as `k[grid](*args, **meta)`: interpreted when any tensor argument is on CPU."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self._compiled: Any = None
        self._interpreted: Any = None

    def __getitem__(self, grid: Grid) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            on_cpu = any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in (*args, *kwargs.values()))
            if not on_cpu:
                if self._compiled is None:
                    self._compiled = triton.jit(self.fn)
                self._compiled[grid](*args, **kwargs)
                return
            if self._interpreted is None:
                self._interpreted = InterpretedFunction(self.fn)
            with _interpreted_library():
                self._interpreted[grid](*args, **kwargs)

        return launch


def kernel(fn: Callable[..., None]) -> Kernel:
    return Kernel(fn)


def outer_stride(t: torch.Tensor, what: str) -> int:
    """Stride of dim 0 (a pool slot, a latent row) of a tensor whose inner dims are contiguous, as the pool's
    per-layer views are: the kernels index slot * stride + the slot's own contiguous offset."""
    if t.dim() < 2:
        raise ValueError(f"{what}: expected at least 2 dims, got shape {tuple(t.shape)}")
    if t.shape[0] == 0:
        return 0
    inner = t[0]
    if not inner.is_contiguous():
        raise ValueError(f"{what}: the dims after the first must be contiguous, got strides {t.stride()}")
    if t.shape[0] > 1 and t.stride(0) < inner.numel():
        raise ValueError(f"{what}: rows overlap (stride {t.stride(0)} < {inner.numel()} elements per row)")
    return t.stride(0)
