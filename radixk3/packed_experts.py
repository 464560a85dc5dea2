"""The routed experts' weights held packed (a compressed-tensors format, `quant_format`): one projection (w1, w2
or w3) of every held expert, stacked [E_held, ...] as the checkpoint stores it, and dequantised per step for the
experts the step routes to (`kernels.quant`). What is held is what the memory plan counts.

Tensor / expert parallelism: this rank holds the experts `held`, and of each the rows `rows` (w1 / w3: part of
the intermediate dim) or the input columns `cols` (w2) of the full [rows, cols] weight; the packed data and the
scales are cut alike (`ExpertQuant.row_index` / `col_index`, which refuse a cut through a scale group).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from kernels.quant import dequant_experts
from radixk3.parallel_linear import PublicPart
from radixk3.quant_format import DATA, SCALE, SHAPE, ExpertQuant
from radixk3.tensor_names import Shard

PACKED_ATTRS = (DATA, SCALE, SHAPE)


def _length(index: slice, size: int) -> int:
    return len(range(*index.indices(size)))


class PackedWeights(nn.Module):
    """q_data [E_held, *data], q_scale [E_held, *scale] (+ q_shape [E_held, 2] for int4: the full weight's
    shape) of one expert projection; public tensors `{e}.{name}.weight_packed` (or `.weight` for fp8),
    `.weight_scale`, `.weight_shape` under the experts module."""

    def __init__(self, quant: ExpertQuant, num_experts: int, held: range, full_rows: int, full_cols: int,
                 rows: slice | None = None, cols: slice | None = None) -> None:
        super().__init__()
        self.quant, self.num_experts, self.held = quant, num_experts, held
        self.full_rows, self.full_cols = full_rows, full_cols
        self.data_full, self.scale_full = quant.shapes(full_rows, full_cols)
        every = slice(None)
        data_index, scale_index = [every, every], [every, every]
        if rows is not None:
            data_index[0], scale_index[0] = quant.row_index(rows, full_rows)
        if cols is not None:
            data_index[1], scale_index[1] = quant.col_index(cols, full_cols)
        self.data_index, self.scale_index = tuple(data_index), tuple(scale_index)
        self.partial = ((rows is not None and _length(rows, full_rows) < full_rows)
                        or (cols is not None and _length(cols, full_cols) < full_cols))
        e = len(held)
        data_shape = [_length(i, n) for i, n in zip(data_index, self.data_full, strict=True)]
        scale_shape = [_length(i, n) for i, n in zip(scale_index, self.scale_full, strict=True)]
        self.register_buffer(DATA, torch.zeros(e, *data_shape, dtype=quant.data_dtype))
        self.register_buffer(SCALE, torch.zeros(e, *scale_shape, dtype=quant.scale_torch_dtype))
        if quant.has_shape:
            self.register_buffer(SHAPE, torch.zeros(e, 2, dtype=torch.int64))

    def dequant(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The local experts `ids` ([A], indices into the held ones) as [A, rows_here, cols_here] in `dtype`."""
        return dequant_experts(self.quant.kind, self.q_data, self.q_scale, ids, dtype)

    def _suffixes(self) -> Iterator[tuple[str, str]]:
        yield DATA, self.quant.data_suffix
        yield SCALE, "weight_scale"
        if self.quant.has_shape:
            yield SHAPE, "weight_shape"

    def public_parts(self, local_name: str) -> Iterator[PublicPart]:
        for j, e in enumerate(self.held):
            for attr, suffix in self._suffixes():
                yield attr, f"{e}.{local_name}.{suffix}", (j,)

    def public_shards(self, local_name: str) -> Iterator[tuple[str, Shard]]:
        if len(self.held) == self.num_experts and not self.partial:
            return
        full = {DATA: self.data_full, SCALE: self.scale_full, SHAPE: (2,)}
        index = {DATA: self.data_index, SCALE: self.scale_index, SHAPE: (slice(None),)}
        for e in range(self.num_experts):
            for attr, suffix in self._suffixes():
                yield f"{e}.{local_name}.{suffix}", Shard(tuple(full[attr]), index[attr] if e in self.held else None)

    def check_shapes(self) -> str | None:
        """After loading: why the checkpoint's `weight_shape`s disagree with the model's, or None."""
        if not self.quant.has_shape:
            return None
        want = torch.tensor([self.full_rows, self.full_cols])
        for j, e in enumerate(self.held):
            if not torch.equal(self.q_shape[j].cpu(), want):
                return f"expert {e} has weight_shape {self.q_shape[j].tolist()}, expected {want.tolist()}"
        return None
