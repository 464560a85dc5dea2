"""Typed views over the pool's byte buffer, and data surviving compaction through them."""

from __future__ import annotations

import pytest
import torch

from runtime.pool_layout import CopyCommand, PoolLayout
from runtime.scheduler.pool import PoolExhausted, UnifiedPool
from runtime.worker.pool_buffer import PoolBuffer
from tests.runtime.pool_rows import token_rows

LAYOUT = PoolLayout(num_kda_layers=2, kda_heads=2, head_dim=4, conv_kernel=4, num_mla_layers=3, kv_dim=6,
                    state_dtype="float32", kv_dtype="bfloat16", page_size=4)
INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _mark(view: torch.Tensor) -> None:
    """Fill with a bit pattern whose every byte is non-zero, to count the bytes a view covers."""
    view.view(INT_OF[view.dtype]).fill_(0x01010101 if view.element_size() == 4 else 0x0101)


def test_view_shapes_dtypes_and_aliasing() -> None:
    buf = PoolBuffer(LAYOUT, 64 * 1024)
    g = buf.geometry
    rec, conv, kv = buf.recurrent_state(1), buf.conv_state(0), buf.kv(2)
    assert rec.shape == (g.num_state_slots, 2, 4, 4) and rec.dtype == torch.float32
    assert conv.shape == (g.num_state_slots, 3 * 2 * 4, 3) and conv.dtype == torch.bfloat16
    assert kv.shape == (g.num_token_slots, 6) and kv.dtype == torch.bfloat16
    for v in (rec, conv, kv):
        assert v.untyped_storage().data_ptr() == buf.data.untyped_storage().data_ptr()
    rec[3, 1, 2, 3] = 7.5
    assert buf.recurrent_state(1)[3, 1, 2, 3].item() == 7.5  # a write through one view is seen by the next
    assert buf.data.count_nonzero().item() > 0


def test_each_state_slot_covers_exactly_its_block() -> None:
    buf = PoolBuffer(LAYOUT, 64 * 1024)
    g = buf.geometry
    for slot in (0, 1, g.num_state_slots - 1):
        buf.data.zero_()
        for layer in range(LAYOUT.num_kda_layers):
            _mark(buf.recurrent_state(layer)[slot])
            _mark(buf.conv_state(layer)[slot])
        nz = buf.data.nonzero().flatten()
        assert nz.numel() == LAYOUT.state_payload_bytes  # no two regions overlap
        lo = g.state_offset(slot)
        assert lo <= nz.min().item() and nz.max().item() < lo + g.state_block_bytes


def test_each_token_slot_covers_its_row_of_its_page() -> None:
    buf = PoolBuffer(LAYOUT, 64 * 1024)
    g = buf.geometry
    for page, offset in ((0, 0), (5, 3), (g.num_pages - 1, 3)):
        buf.data.zero_()
        t = page * g.page_size + offset
        for layer in range(LAYOUT.num_mla_layers):
            _mark(buf.kv(layer)[t])
        nz = buf.data.nonzero().flatten()
        assert nz.numel() == LAYOUT.kv_token_bytes
        lo = g.page_offset(page) + offset * LAYOUT.kv_token_bytes
        assert (nz.min().item(), nz.max().item()) == (lo, lo + LAYOUT.kv_token_bytes - 1)


def _write_state(buf: PoolBuffer, slot: int, value: float) -> None:
    for layer in range(LAYOUT.num_kda_layers):
        buf.recurrent_state(layer)[slot] = value + layer
        buf.conv_state(layer)[slot] = value - layer


def _state_ok(buf: PoolBuffer, slot: int, value: float) -> bool:
    return all(bool((buf.recurrent_state(layer)[slot] == value + layer).all())
               and bool((buf.conv_state(layer)[slot] == value - layer).all())
               for layer in range(LAYOUT.num_kda_layers))


def test_data_survives_compaction_through_the_views() -> None:
    total = 40 * 1024
    pool, buf = UnifiedPool(LAYOUT, total), PoolBuffer(LAYOUT, total)
    g = pool.geometry
    states = [pool.alloc_state() for _ in range(g.num_state_slots // 2)]
    per_page = g.page_size
    pages: list[int] = []
    while True:  # fill the KV side up to the states
        try:
            pages += pool.alloc_pages(1)
        except PoolExhausted:
            break
    assert pool.usage().gap_bytes < g.page_bytes
    for i, s in enumerate(states):
        _write_state(buf, pool.state_slot(s), float(10 * i))
    for i, p in enumerate(pages):
        rows = token_rows(pool, [p], 0, per_page)
        for layer in range(LAYOUT.num_mla_layers):
            buf.kv(layer)[rows] = float(i % 200 + layer)
    # Free every other state and every other page: holes on both sides, no gap.
    live_states = states[1::2]
    live_pages = pages[1::2]
    for s in states[0::2]:
        pool.free_state(s)
    pool.free_pages(pages[0::2])
    pool.drain_copies()
    # A run of pages larger than the KV holes forces the state side to compact...
    extra = pool.alloc_pages(len(pages) // 2 + 10)
    copies = pool.drain_copies()
    assert copies and all(c.nbytes == g.state_block_bytes for c in copies)
    # ... and once the state holes are used up, state allocations compact the KV side.
    pool.free_pages(extra[0::2])
    new_states = [pool.alloc_state() for _ in range(pool.usage().state_holes + 2)]
    copies += pool.drain_copies()
    assert any(c.nbytes == g.page_bytes for c in copies)
    moved_bytes = buf.apply_copies(copies)
    assert moved_bytes == sum(c.nbytes for c in copies)
    pool.check_integrity()
    for i, s in enumerate(states):
        if s in live_states:
            assert _state_ok(buf, pool.state_slot(s), float(10 * i)), f"state {s} lost in compaction"
    for i, p in enumerate(pages):
        if p in live_pages:
            rows = token_rows(pool, [p], 0, per_page)
            for layer in range(LAYOUT.num_mla_layers):
                assert bool((buf.kv(layer)[rows] == float(i % 200 + layer)).all()), f"page {p} lost"
    assert len(new_states) > 2


def test_state_copy_and_bad_copies() -> None:
    total = 16 * 1024
    pool, buf = UnifiedPool(LAYOUT, total), PoolBuffer(LAYOUT, total)
    a, b = pool.alloc_state(), pool.alloc_state()
    _write_state(buf, pool.state_slot(a), 3.0)
    pool.copy_state(a, b)
    buf.apply_copies(pool.drain_copies())
    assert _state_ok(buf, pool.state_slot(b), 3.0)
    with pytest.raises(ValueError):
        buf.apply_copies([CopyCommand(0, 8, 16)])
    with pytest.raises(ValueError):
        buf.apply_copies([CopyCommand(0, buf.geometry.total_bytes - 8, 16)])
