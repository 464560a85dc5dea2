"""Which shard of the model this process holds: its tensor-parallel and expert-parallel ranks and the
torch.distributed group they run their collectives in.

One process-wide `ParallelState`, single-rank by default, so that every layer built without `init_parallel`
is the unsharded model (the oracle). DP attention (`dp_size` > 1, as SGLang's --enable-dp-attention): the TP
ranks form dp_size attention groups of attn_tp = tp_size / dp_size consecutive ranks; attention layers (and
the embedding and LM head) are built inside `attention_tp()` and shard over their group only, each group
running its own requests' tokens; the FFN stays sharded over every rank and runs on every group's tokens
(`dp_gather`, then each group takes its own rows back). A worker calls `init_parallel` once, before it builds
its model; layers read `parallel_state()` when they are built, to size their shards, and keep their group
for their collectives.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple, NoReturn

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
    dp_size: int = 1  # DP attention groups (1: attention is tensor-parallel over the whole TP group)
    attn_group: dist.ProcessGroup | None = None  # this rank's attention group (the TP group when dp_size == 1)

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if self.tp_size % self.ep_size or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_size {self.ep_size} (rank {self.ep_rank}) must divide tp_size {self.tp_size}")
        if self.dp_size < 1 or self.tp_size % self.dp_size:
            raise ValueError(f"dp_size {self.dp_size} must divide tp_size {self.tp_size}")
        if self.dp_size == 1 and self.attn_group is None:
            object.__setattr__(self, "attn_group", self.group)

    @property
    def sharded(self) -> bool:
        return self.tp_size > 1

    @property
    def dp_attention(self) -> bool:
        return self.dp_size > 1

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size // self.dp_size

    @property
    def attn_tp_rank(self) -> int:
        return self.tp_rank % self.attn_tp_size

    @property
    def dp_rank(self) -> int:
        """This rank's attention group: ranks [dp_rank * attn_tp, (dp_rank + 1) * attn_tp)."""
        return self.tp_rank // self.attn_tp_size

    def attention_view(self) -> ParallelState:
        """The state attention layers are built in: plain TP over this rank's attention group (no experts)."""
        if self.dp_size == 1:
            return self
        return ParallelState(tp_rank=self.attn_tp_rank, tp_size=self.attn_tp_size,
                             group=self.attn_group if self.attn_tp_size > 1 else None)


class Group(NamedTuple):
    """A layer's rank and size in the group it shards over, and that group (None: one rank, no collective)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None


_STATE = ParallelState()


def parallel_state() -> ParallelState:
    return _STATE


def set_parallel_state(state: ParallelState) -> None:
    global _STATE
    _STATE = state


def collective_backend(device: str | torch.device) -> str:
    """The torch.distributed backend for a group whose tensors live on `device`: NCCL for CUDA tensors, gloo
    for CPU ones. The rank's device decides, not what the machine has: `--device cpu` ranks on a GPU machine
    hand CPU tensors to their collectives, which NCCL cannot take."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_parallel(
    rank: int,
    world_size: int,
    init_method: str,
    ep_size: int = 1,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    dp_size: int = 1,
    device: str | torch.device = "cpu",
) -> ParallelState:
    """Join the `world_size`-rank TP group at `init_method` (e.g. "tcp://127.0.0.1:29500") as `rank`, whose
    tensors live on `device`: the backend is the device's (`collective_backend`) unless `backend` says
    otherwise. Expert-parallel ranks are the TP ranks in blocks of tp_size / ep_size (rank r holds expert shard
    r // (tp_size / ep_size)). `dp_size` > 1: DP attention with dp_size attention groups of world_size / dp_size
    consecutive ranks."""
    if world_size % dp_size:
        raise ValueError(f"--dp {dp_size} must divide --tp {world_size} (DP attention)")
    if world_size == 1:
        state = ParallelState(ep_size=ep_size)
        set_parallel_state(state)
        return state
    device = torch.device(device)
    backend = backend or collective_backend(device)
    if device.type == "cuda":  # NCCL binds each rank's communicator to the current device
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    attn_group = None
    if dp_size > 1:
        a = world_size // dp_size
        # new_group is collective: every rank creates every group, in the same order.
        for g in range(dp_size):
            made = dist.new_group(list(range(g * a, (g + 1) * a)), timeout=timeout)
            if g == rank // a:
                attn_group = made
    state = ParallelState(tp_rank=rank, tp_size=world_size, ep_rank=rank // (world_size // ep_size),
                          ep_size=ep_size, group=dist.group.WORLD, dp_size=dp_size, attn_group=attn_group)
    set_parallel_state(state)
    return state


def destroy_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    set_parallel_state(ParallelState())


def exit_rank(code: int = 0) -> NoReturn:
    """End a rank's process without interpreter finalization. The group outlives `destroy_parallel` while any
    layer still holds it, and gloo's worker threads release a finished collective's tensors after the caller
    has its result, which takes the GIL: if that lands while the interpreter finalizes, the thread cannot get it
    and the process aborts ("terminate called without an active exception"), however well its work went."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP group (in place; the identity on one rank)."""
    state = _STATE
    if state.tp_size > 1:
        dist.all_reduce(x, group=state.group)
    return x


def tp_min(value: int, device: str | torch.device) -> int:
    """The smallest `value` over the TP group, on every rank (`value` itself on one rank). `device`: the
    group's (the tensor the collective takes lives there)."""
    state = _STATE
    if state.tp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=state.group)
    return int(t.item())


def all_reduce(x: torch.Tensor, g: Group) -> torch.Tensor:
    """Sum `x` over `g` (in place; the identity on one rank)."""
    if g.size > 1:
        dist.all_reduce(x, group=g.group)
    return x


def all_reduce_max(x: torch.Tensor, g: Group) -> torch.Tensor:
    """The elementwise max of `x` over `g` (in place; the identity on one rank)."""
    if g.size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=g.group)
    return x


def all_gather(x: torch.Tensor, g: Group, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank of `g`'s `x` along `dim`, in rank order."""
    if g.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(g.size)]
    dist.all_gather(parts, x.contiguous(), group=g.group)
    return torch.cat(parts, dim=dim)


@contextlib.contextmanager
def attention_tp() -> Iterator[None]:
    """Build modules inside this block as attention layers: sharded over this rank's attention group (with DP
    attention; otherwise the TP group, and this is a no-op). Layers remember their group for their collectives."""
    saved = _STATE
    set_parallel_state(saved.attention_view())
    try:
        yield
    finally:
        set_parallel_state(saved)


class DPRows(NamedTuple):
    """Every attention group's token rows, gathered for the FFN, and where this group's rows sit in them."""

    rows: torch.Tensor  # [sum of the groups' tokens, hidden], in DP-group order
    start: int
    count: int


def dp_gather(x: torch.Tensor) -> DPRows:
    """Gather the rows of every attention group (variable counts: all-reduce the counts, pad to the largest,
    all_gather over every rank, unpad). A group with no tokens joins with zero rows (the idle batch). The
    ranks of one group hold the same rows: each group's first rank's copy is used."""
    s = _STATE
    counts = torch.zeros(s.tp_size, dtype=torch.int64, device=x.device)  # on the group's device (NCCL: CUDA)
    counts[s.tp_rank] = x.shape[0]
    dist.all_reduce(counts, group=s.group)
    per_group = counts[:: s.attn_tp_size].tolist()
    start = sum(per_group[: s.dp_rank])
    most = max(per_group)
    if most == 0:
        return DPRows(x, 0, 0)
    padded = x.new_zeros(most, *x.shape[1:])
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(s.tp_size)]
    dist.all_gather(parts, padded, group=s.group)
    rows = torch.cat([parts[g * s.attn_tp_size][:n] for g, n in enumerate(per_group)])
    return DPRows(rows, start, x.shape[0])


def dp_scatter(y: torch.Tensor, where: DPRows) -> torch.Tensor:
    """This group's rows of the FFN output `y` (whole on every rank: the FFN's own all-reduce made it so, so
    giving each group its rows back is a slice; reduce_scatter would fuse the two where the backend has it)."""
    return y[where.start: where.start + where.count]


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


# What gloo / NCCL errors say when a peer rank died, hangs past the timeout, or closed its connection.
_COLLECTIVE_MARKERS = ("gloo", "nccl", "connection closed by peer", "connection reset by peer", "timed out waiting")


def is_collective_failure(e: BaseException) -> bool:
    """Whether `e` means the group is broken (fatal for the rank), not a failure of one step's inputs."""
    if any(c.__name__ == "DistError" for c in type(e).__mro__):  # torch.distributed's own error types
        return True
    return isinstance(e, RuntimeError) and any(m in str(e).lower() for m in _COLLECTIVE_MARKERS)
