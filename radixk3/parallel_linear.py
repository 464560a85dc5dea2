"""Tensor-parallel layers (as nano-vllm's `layers/linear.py` / `embed_head.py` and SGLang's parallel linears).

Each layer reads `parallel_state()` once, when it is built, to size its shard, and remembers its rank and size:
built single-rank (or inside `parallel.replicated()`) it is the plain layer and runs no collective.
- `ColumnParallelLinear`: output rows split; the output stays split (per head, or the input of a row-parallel
  linear). With `parts` (fused projections: gate|up, q|k|v) every part is split separately, so each rank holds
  its rows of every part, still fused in one GEMM.
- `RowParallelLinear`: input columns split; the partial products are summed over the group (`tp_all_reduce`).
- `VocabParallelEmbedding`: vocabulary rows split; each rank looks up the ids it holds, zeros the rest, and the
  group sums.
- `ParallelLMHead`: vocabulary rows split; local logits, gathered over the vocabulary.
The vocabulary is padded to a multiple of tp when it does not split (the padding rows are zero, never public,
and cut off the logits).
Each declares `public_shards`: which part of which public (checkpoint) tensor this rank holds.
Each keeps the group it was built for and runs its collectives there: built inside `parallel.attention_tp()`
(attention layers under DP attention) that is the attention group. The embedding and LM head always shard over
the attention group (each DP group embeds and scores its own tokens).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kernels import linear_cpu
from radixk3.parallel import Group, all_gather, all_reduce, parallel_state, shard_range
from radixk3.tensor_names import Shard

# (parameter attribute, public tensor name relative to the module's parent, index of its part in the parameter)
PublicPart = tuple[str, str, tuple[int | slice, ...]]


def row_parts(attr: str, parts: Sequence[tuple[str, int]]) -> Iterator[PublicPart]:
    """Public tensors `{name}.weight` of the given (local) row counts, stacked in this order in `attr`."""
    start = 0
    for name, rows in parts:
        yield attr, f"{name}.weight", (slice(start, start + rows),)
        start += rows


class Linear(nn.Linear):
    """Bias-free nn.Linear whose GEMM (`matmul`) runs on a weight-only quantised copy of the weight once
    `radixk3.weight_quant` has set `quantized` (and dropped the dense weight: the weights are held once)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.quantized: nn.Module | None = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized(x)
        if torch.compiler.is_compiling() and linear_cpu.applies(x, self.weight):  # a compiled decode step on CPU
            return linear_cpu.linear(x, self.weight)
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)


def linears(x: torch.Tensor, layers: Sequence[Linear]) -> list[torch.Tensor]:
    """Each layer's x @ W^T, for layers that take the same input and reduce nothing (not row-parallel): in a
    compiled decode step on CPU where the few-row op serves them all, one call over their weights
    (`linear_cpu.linears`, each output the bits of its own call), else each layer's own."""
    if torch.compiler.is_compiling() and all(
            layer.quantized is None and linear_cpu.applies(x, layer.weight) for layer in layers):
        return linear_cpu.linears(x, [layer.weight for layer in layers])
    return [layer(x) for layer in layers]


class TPRank:
    """The TP rank and size a layer was built for, and the group its collectives run in."""

    tp_rank: int
    tp_size: int
    tp_group: Group

    def _take_rank(self, attention: bool = False) -> None:
        state = parallel_state().attention_view() if attention else parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.tp_group = Group(state.tp_rank, state.tp_size, state.group)


class ColumnParallelLinear(Linear, TPRank):
    """Bias-free y = x W^T with W's rows split over the TP ranks in whole `unit`s (a head's rows).

    `parts` (name, full rows): the checkpoint's separate tensors `{name}.weight` (siblings of this module)
    stacked by rows, each split separately; this rank's weight is its rows of each part, in part order. Without
    `parts` the module's own `weight` is the public tensor."""

    def __init__(self, in_features: int, out_features: int | None = None, *,
                 parts: Sequence[tuple[str, int]] | None = None, unit: int = 1) -> None:
        self._take_rank()
        if (out_features is None) == (parts is None):
            raise ValueError("give out_features or parts, not both")
        full = list(parts) if parts is not None else [("", out_features or 0)]
        self.row_slices = [shard_range(rows, self.tp_rank, self.tp_size, unit) for _, rows in full]
        self.sizes = [s.stop - s.start for s in self.row_slices]  # local rows of each part
        self.parts = tuple(parts) if parts is not None else None
        self.full_rows = [rows for _, rows in full]
        super().__init__(in_features, sum(self.sizes))

    def public_parts(self, local_name: str) -> Iterator[PublicPart]:
        if self.parts is None:
            return iter(())
        return row_parts("weight", [(name, rows) for (name, _), rows in zip(self.parts, self.sizes, strict=True)])

    def public_shards(self, local_name: str) -> Iterator[tuple[str, Shard]]:
        if self.tp_size == 1:
            return
        names = [f"{name}.weight" for name, _ in self.parts] if self.parts else [f"{local_name}.weight"]
        for name, rows, index in zip(names, self.full_rows, self.row_slices, strict=True):
            yield name, Shard((rows, self.in_features), (index,))


class RowParallelLinear(Linear, TPRank):
    """Bias-free y = x W^T with W's input columns split over the TP ranks (x arrives split the same way);
    the partial products are summed over the group unless `reduce_results` is False (the caller sums several
    partial outputs with one all-reduce)."""

    def __init__(self, in_features: int, out_features: int, *, unit: int = 1, reduce_results: bool = True) -> None:
        self._take_rank()
        self.full_in = in_features
        self.col_slice = shard_range(in_features, self.tp_rank, self.tp_size, unit)
        self.reduce_results = reduce_results
        super().__init__(self.col_slice.stop - self.col_slice.start, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if self.tp_size > 1 and self.reduce_results:
            all_reduce(y, self.tp_group)
        return y

    def public_shards(self, local_name: str) -> Iterator[tuple[str, Shard]]:
        if self.tp_size > 1:
            yield f"{local_name}.weight", Shard((self.out_features, self.full_in), (slice(None), self.col_slice))


class _VocabShard(TPRank):
    """The rows [start, start + valid) of a [vocab, dim] tensor padded to a multiple of tp."""

    vocab_size: int
    padded_vocab: int
    vocab_start: int
    num_valid: int

    def _split_vocab(self, vocab_size: int) -> int:
        self._take_rank(attention=True)
        self.vocab_size = vocab_size
        self.padded_vocab = -(-vocab_size // self.tp_size) * self.tp_size
        local = self.padded_vocab // self.tp_size
        self.vocab_start = self.tp_rank * local
        self.num_valid = max(0, min(local, vocab_size - self.vocab_start))
        return local

    def _vocab_parts(self, local_name: str) -> Iterator[PublicPart]:
        # Padded rows are not public: the public tensor is the valid rows only.
        if self.num_valid < self.padded_vocab // self.tp_size:
            yield "weight", f"{local_name}.weight", (slice(0, self.num_valid),)

    def _vocab_shards(self, local_name: str, dim: int) -> Iterator[tuple[str, Shard]]:
        if self.tp_size > 1:
            rows = slice(self.vocab_start, self.vocab_start + self.num_valid)
            yield f"{local_name}.weight", Shard((self.vocab_size, dim), (rows,))


class VocabParallelEmbedding(nn.Embedding, _VocabShard):
    """Embedding with the vocabulary split over the TP ranks: exact (one rank contributes each row, the others
    zeros), so every rank ends with the same full embedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(self._split_vocab(num_embeddings), embedding_dim)
        with torch.no_grad():
            self.weight[self.num_valid:] = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1 or ids.numel() == 0:  # no tokens: the whole attention group is idle alike
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_valid)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out, self.tp_group)

    def public_parts(self, local_name: str) -> Iterator[PublicPart]:
        return self._vocab_parts(local_name)

    def public_shards(self, local_name: str) -> Iterator[tuple[str, Shard]]:
        return self._vocab_shards(local_name, self.embedding_dim)


class ParallelLMHead(Linear, _VocabShard):
    """Bias-free LM head with the vocabulary split over the TP ranks: local logits gathered over the vocabulary
    (exact), the padding cut off: [..., vocab_size] on every rank."""

    def __init__(self, hidden: int, vocab_size: int) -> None:
        super().__init__(hidden, self._split_vocab(vocab_size))
        with torch.no_grad():
            self.weight[self.num_valid:] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(x)
        if self.tp_size == 1:
            return logits
        if logits.numel() == 0:  # no tokens: the whole attention group is idle alike
            return logits.new_zeros(*logits.shape[:-1], self.vocab_size)
        return all_gather(logits, self.tp_group, dim=-1)[..., : self.vocab_size]

    def public_parts(self, local_name: str) -> Iterator[PublicPart]:
        return self._vocab_parts(local_name)

    def public_shards(self, local_name: str) -> Iterator[tuple[str, Shard]]:
        return self._vocab_shards(local_name, self.in_features)
