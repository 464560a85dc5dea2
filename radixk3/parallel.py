"""Which shard of the model this process holds: its tensor-parallel and expert-parallel ranks and the
torch.distributed group they run their collectives in.

One process-wide `ParallelState`, single-rank by default, so that every layer built without `init_parallel`
is the unsharded model (the oracle). A worker calls `init_parallel` once, before it builds its model; layers
read `parallel_state()` when they are built, to size their shards, and when they run, for collectives.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A collective that waits longer than this fails (gloo and NCCL both honour the group's timeout), so that a
# rank that died or hangs makes the others fail instead of hanging.
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0  # expert-parallel rank inside the TP group (ep_size divides tp_size)
    ep_size: int = 1
    group: dist.ProcessGroup | None = None  # the TP group; None when tp_size == 1

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if self.tp_size % self.ep_size or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_size {self.ep_size} (rank {self.ep_rank}) must divide tp_size {self.tp_size}")

    @property
    def sharded(self) -> bool:
        return self.tp_size > 1


_STATE = ParallelState()


def parallel_state() -> ParallelState:
    return _STATE


def set_parallel_state(state: ParallelState) -> None:
    global _STATE
    _STATE = state


def init_parallel(
    rank: int,
    world_size: int,
    init_method: str,
    ep_size: int = 1,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ParallelState:
    """Join the `world_size`-rank TP group at `init_method` (e.g. "tcp://127.0.0.1:29500") as `rank`; gloo on
    CPU, NCCL on CUDA unless `backend` says otherwise. Expert-parallel ranks are the TP ranks in blocks of
    tp_size / ep_size (rank r holds expert shard r // (tp_size / ep_size))."""
    if world_size == 1:
        state = ParallelState(ep_size=ep_size)
        set_parallel_state(state)
        return state
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    state = ParallelState(tp_rank=rank, tp_size=world_size, ep_rank=rank // (world_size // ep_size),
                          ep_size=ep_size, group=dist.group.WORLD)
    set_parallel_state(state)
    return state


def destroy_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    set_parallel_state(ParallelState())


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP group (in place; the identity on one rank)."""
    state = _STATE
    if state.tp_size > 1:
        dist.all_reduce(x, group=state.group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's `x` along `dim`, in rank order (`x` itself on one rank)."""
    state = _STATE
    if state.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=state.group)
    return torch.cat(parts, dim=dim)


@contextlib.contextmanager
def replicated() -> Iterator[None]:
    """Build modules inside this block unsharded (single-rank state): every TP rank then holds the whole module
    and runs it without collectives (e.g. a small drafter that stays replicated under --tp)."""
    saved = _STATE
    set_parallel_state(ParallelState())
    try:
        yield
    finally:
        set_parallel_state(saved)


def shard_range(n: int, rank: int, size: int, unit: int = 1) -> slice:
    """Rank `rank`'s contiguous part of `n` items split evenly over `size` ranks, in whole `unit`s (heads)."""
    if n % (size * unit):
        raise ValueError(f"{n} items ({n // unit} units of {unit}) do not split evenly over tp={size}")
    part = n // size
    return slice(rank * part, (rank + 1) * part)
