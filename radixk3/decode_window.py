"""A window of compiled decode steps (`--num-scheduler-steps`) with its inputs built once.

Inside a window the rows, their KDA slots and their pages stay the same and every row's KV grows by one token a
step, so the padded inputs of all its steps are built together, at the window's last width: a step feeds the
previous one's samples and takes its own row table and new-latent slots. Positions past a row's length are
masked (and name its last written row), so the wider table changes nothing the graph computes. One check of
every slot the window writes replaces each step's; what a step still does outside the graph is its radix
checkpoints' slot copies (`DecodeGraphs.run` says why copies suffice). A sequence that samples a stop token
feeds it and is then parked on the scratch slot and row for the rest of the window, so that its state is exactly
its request's at the stop and can be donated to the radix tree. At batch 1 this spares each token ~0.3 ms
of host work (the step's ForwardBatch, the padded inputs and row table, the checks) beside a ~5 ms graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.state_checkpoints import StateCheckpoints
from radixk3.attention_backend import decode_checkpoints
from radixk3.decode_graph import DecodeGraphs, PaddedDecode, pad_rows, row_table
from radixk3.forward_batch import ForwardBatch


class DecodeWindow:
    """`steps` decode steps of one batch through `graphs`. `first`: the first step's batch (its checkpoints are
    passed to `step`, not read from it); `block_table` [N, P]: each row's pages, spanning the window's last
    token."""

    def __init__(self, graphs: DecodeGraphs, first: ForwardBatch, block_table: Tensor, steps: int) -> None:
        n = first.num_seqs
        b = graphs.bucket(n)
        if b is None or not graphs.supports(first):
            raise ValueError(f"a window of {n} rows the decode graphs do not cover")
        self.graphs, self.num_seqs, self.steps = graphs, n, steps
        s, dev = graphs.scratch, first.input_ids.device
        last_lens = first.seq_lens + (steps - 1)
        longest = int(last_lens.max())
        if block_table.shape[1] * first.page_size < longest:
            raise ValueError(f"a block table of {block_table.shape[1]} pages for a window whose last step reads "
                             f"{longest} tokens")
        width = graphs.kv_width(longest)
        # Each step's KV lengths and row table at the window's width: positions past a step's length name its last
        # written row, never a later step's slot (unwritten yet: a path that multiplies masked positions by zero,
        # the torch MLA attention, would turn stale non-finite bytes there into NaN).
        lens = first.seq_lens[:, None] + torch.arange(steps, device=dev)  # [N, steps]
        tables = row_table(block_table.to(dev).repeat_interleave(steps, 0), first.page_size, lens.reshape(-1),
                           width).view(n, steps, width)
        written = tables.gather(2, (lens - 1)[..., None])[..., 0]  # [N, steps]: the slot each step stores to
        graphs.validate(first.state_slots, None, written.reshape(-1))  # every slot the window writes, once
        # Step j's inputs, each a contiguous tensor of its own: the compiled step guards on its inputs' strides (a
        # column of a [B, steps] tensor would compile it again).
        self._written = _per_step(pad_rows(written, b, s.kv_row))
        self._rows = _per_step(pad_rows(tables, b, s.kv_row))
        self._lens = _per_step(pad_rows(lens, b, 1))
        self._ids = pad_rows(first.input_ids, b, 0).clone()  # fed in place: not the batch's own tensor
        self._slots = first.state_slots  # the rows' own: checks and checkpoints read them
        self._state_slots = pad_rows(first.state_slots, b, s.state_slot).clone()  # parked rows' become the scratch
        self._next = 0
        self._stopping: list[int] = []

    def step(self, input_ids: Tensor | None, checkpoints: StateCheckpoints | None) -> Tensor:
        """The next step's logits [N, V] fp32. `input_ids` [N]: the tokens the previous step sampled (None for
        the first step, which feeds `first`'s); `checkpoints`: the step's radix checkpoints (offset 0: the state
        before its token, 1: after)."""
        j = self._next
        if j >= self.steps:
            raise ValueError(f"a window of {self.steps} steps asked for step {j + 1}")
        if j > 0:
            if input_ids is None:
                raise ValueError("a window's later steps feed the tokens the step before sampled")
            self._ids[: self.num_seqs] = input_ids
        self._next += 1
        g = self.graphs
        before = after = None
        if checkpoints is not None and len(checkpoints.slot):
            g.validate(self._slots, checkpoints, self._slots[:0])  # (its KV slots were checked with the window's)
            before, after = decode_checkpoints(self._slots, checkpoints)
        g.copy_states(before)
        g.replays += 1
        out = g.call(PaddedDecode(self._ids, self._state_slots, self._written[j], self._rows[j], self._lens[j]))
        g.copy_states(after)
        if self._stopping:
            self._park(self._stopping, j)
            self._stopping = []
        return out.logits[: self.num_seqs]

    def stop(self, seqs: list[int]) -> None:
        """Sequences that sampled a stop token at the step just run: they feed it at the next step and nothing
        after, so that their state and KV stay their request's at the stop (a checkpoint of them after that is
        not theirs: the scheduler drops those)."""
        self._stopping.extend(seqs)

    def _park(self, seqs: list[int], j: int) -> None:
        """From step j + 1 on, `seqs` run as padding rows do: on the scratch state slot, their new latents stored
        in the scratch KV row, their length held at step j's (every position read is theirs and written)."""
        idx = torch.tensor(seqs, device=self._ids.device)
        s = self.graphs.scratch
        self._state_slots[idx] = s.state_slot
        for later in self._written[j + 1 :]:
            later[idx] = s.kv_row
        for per_step in (self._rows, self._lens):
            for later in per_step[j + 1 :]:
                later[idx] = per_step[j][idx]


def _per_step(x: Tensor) -> list[Tensor]:
    """x [B, steps, ...] as one contiguous [B, ...] tensor per step."""
    return [x[:, j].clone(memory_format=torch.contiguous_format) for j in range(x.shape[1])]
