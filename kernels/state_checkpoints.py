"""Where a prefill should emit states besides each sequence's final one (the radix tree's checkpoints)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class StateCheckpoints(NamedTuple):
    """Checkpoint m = the state of sequence `seq[m]` after its first `offset[m]` tokens of this call
    (0 = the initial state, len = the final one), written to pool slot `slot[m]`. All [M] int64."""

    seq: Tensor
    offset: Tensor
    slot: Tensor

    def pairs(self) -> list[tuple[int, int]]:
        return list(zip(self.seq.tolist(), self.offset.tolist(), strict=True))


def check_slots(state_slots: Tensor, checkpoints: StateCheckpoints | None, num_slots: int) -> None:
    """Argument checks shared by the pool ops: slots in range, live slots distinct, checkpoint slots distinct
    and apart from the live ones (a kernel may read a live slot while it writes the checkpoints).

    Reads the slots on the host (a device sync on a GPU). Every KDA layer of a step takes the same slots, so
    a caller may run this once per step and pass `validate=False` to the per-layer ops."""
    if checkpoints is not None and not len(checkpoints.seq) == len(checkpoints.offset) == len(checkpoints.slot):
        raise ValueError("checkpoint seq/offset/slot lengths differ")
    live = state_slots.tolist()
    ck = checkpoints.slot.tolist() if checkpoints is not None else []
    for s in (*live, *ck):
        if not 0 <= s < num_slots:
            raise ValueError(f"slot {s} outside the pool of {num_slots}")
    if len(set(live)) != len(live) or len(set(ck)) != len(ck) or set(live) & set(ck):
        raise ValueError(f"slots must be distinct: live {live}, checkpoints {ck}")


def check_num_tokens(num_tokens: Tensor, limit: int) -> None:
    """Replay counts: each in [0, limit], the number of saved tokens per sequence (a host read, as
    `check_slots`)."""
    counts = num_tokens.tolist()
    if any(not 0 <= c <= limit for c in counts):
        raise ValueError(f"num_tokens {counts} outside [0, {limit}]")
