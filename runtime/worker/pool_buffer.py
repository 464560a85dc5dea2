"""The pool's bytes (the worker's side): one uint8 tensor, typed per-layer views into it, and the byte
copies that the allocator's compaction and copy-on-hit queue."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from runtime.pool_layout import ALIGN, CopyCommand, PoolGeometry, PoolLayout, dtype_bytes


def torch_dtype(name: str) -> torch.dtype:
    """A layout's dtype (torch's name, `pool_layout.DTYPE_BYTES`) as the worker's tensors take it."""
    return getattr(torch, name)


class PoolBuffer:
    """One rank's pool buffer. Views alias the buffer: writes through them land in it, and a slot index is
    only meaningful while the allocator has it in use.

    With `scratch`, the buffer also holds, past the scheduler's `total_bytes`, one state slot
    (`scratch_state_slot`, right above the last one) and one KV row (`scratch_kv_row`, the first whole row past
    that slot): where the padded rows of a captured decode step read and write, which no sequence ever owns."""

    def __init__(self, layout: PoolLayout, total_bytes: int, device: torch.device | str = "cpu",
                 scratch: bool = False) -> None:
        self.layout = layout
        self.geometry: PoolGeometry = layout.geometry(total_bytes)
        g = self.geometry
        self.scratch_state_slot: int | None = None
        self.scratch_kv_row: int | None = None
        self._state_rows, self._kv_rows, size = g.num_state_slots, g.num_token_slots, g.total_bytes
        if scratch:
            kt = layout.kv_token_bytes
            self.scratch_state_slot = g.num_state_slots  # starts at total_bytes: slot num_state_slots-1 ends there
            self.scratch_kv_row = -(-(g.total_bytes + g.state_block_bytes) // kt)
            self._state_rows, self._kv_rows = g.num_state_slots + 1, self.scratch_kv_row + 1
            size = -(-self._kv_rows * kt // ALIGN) * ALIGN
        self.data = torch.zeros(size, dtype=torch.uint8, device=device)
        if self.data.data_ptr() % 16:
            raise RuntimeError("pool buffer is not 16-byte aligned")

    def _typed(self, dtype: str) -> torch.Tensor:
        # ALIGN-multiple total size makes every dtype view of the whole buffer legal.
        return self.data.view(torch_dtype(dtype))

    def _part(self, draft: bool) -> tuple[PoolLayout, int, int]:
        """The layout of the target's (or the nested draft model's) part, and its byte offsets inside a state
        block and a token row. Strides always come from the whole layout."""
        lay = self.layout
        if not draft:
            return lay, 0, 0
        if lay.draft is None:
            raise ValueError("this pool has no draft model part")
        return lay.draft, lay.draft_state_offset, lay.draft_kv_offset

    def recurrent_state(self, layer: int, draft: bool = False) -> torch.Tensor:
        """KDA layer `layer`'s recurrent states, [num_state_slots, H/tp, K, V] in the state dtype (`draft`: the
        draft model's layer)."""
        g = self.geometry
        part, base, _ = self._part(draft)
        es = dtype_bytes(part.state_dtype)
        h, k, v = part.recurrent_shape
        offset = g.state_base + base + part.recurrent_offset(layer)
        assert offset % es == 0 and g.state_block_bytes % es == 0
        return torch.as_strided(
            self._typed(part.state_dtype),
            (self._state_rows, h, k, v),
            (g.state_block_bytes // es, k * v, v, 1),
            offset // es,
        )

    def conv_state(self, layer: int, draft: bool = False) -> torch.Tensor:
        """KDA layer `layer`'s conv states, [num_state_slots, 3*H*D/tp, conv_kernel-1] in the model dtype."""
        g = self.geometry
        part, base, _ = self._part(draft)
        es = dtype_bytes(part.kv_dtype)
        c, w = part.conv_shape
        offset = g.state_base + base + part.conv_offset(layer)
        assert offset % es == 0 and g.state_block_bytes % es == 0
        return torch.as_strided(
            self._typed(part.kv_dtype), (self._state_rows, c, w), (g.state_block_bytes // es, w, 1), offset // es
        )

    def kv(self, layer: int, draft: bool = False) -> torch.Tensor:
        """MLA layer `layer`'s latent KV, [num_token_slots, kv_dim] in the model dtype; row p*page_size + o is
        page p, offset o."""
        lay = self.layout
        part, _, base = self._part(draft)
        es = dtype_bytes(part.kv_dtype)
        offset = base + part.kv_offset(layer)
        assert offset % es == 0 and lay.kv_token_bytes % es == 0
        return torch.as_strided(
            self._typed(part.kv_dtype), (self._kv_rows, part.kv_dim), (lay.kv_token_bytes // es, 1), offset // es
        )

    def state_bytes(self, slot: int) -> torch.Tensor:
        """The raw bytes of physical state slot `slot`."""
        off = self.geometry.state_offset(slot)
        return self.data[off : off + self.geometry.state_block_bytes]

    def page_bytes(self, page: int) -> torch.Tensor:
        off = self.geometry.page_offset(page)
        return self.data[off : off + self.geometry.page_bytes]

    def apply_copies(self, commands: Iterable[CopyCommand]) -> int:
        """Perform queued byte copies in order; return the bytes copied."""
        total = 0
        n = self.geometry.total_bytes
        for c in commands:
            if not (0 <= c.src and 0 <= c.dst and max(c.src, c.dst) + c.nbytes <= n):
                raise ValueError(f"copy {c} runs outside the {n}-byte buffer")
            if abs(c.src - c.dst) < c.nbytes:
                raise ValueError(f"copy {c} overlaps itself")
            self.data[c.dst : c.dst + c.nbytes].copy_(self.data[c.src : c.src + c.nbytes])
            total += c.nbytes
        return total
