"""Sizes and offsets of the pool layout, from plain numbers and from the model presets."""

from __future__ import annotations

import pytest

from runtime.pool_layout import ALIGN, PoolLayout


def small(**kw: object) -> PoolLayout:
    args: dict[str, object] = dict(num_kda_layers=3, kda_heads=2, head_dim=4, conv_kernel=4, num_mla_layers=2,
                                   kv_dim=6, state_dtype="float32", kv_dtype="bfloat16", page_size=1)
    args.update(kw)
    return PoolLayout(**args)  # type: ignore[arg-type]


def test_state_block_regions_are_aligned_and_disjoint() -> None:
    lay = small()
    assert lay.recurrent_bytes == 2 * 4 * 4 * 4
    assert lay.conv_bytes == 3 * 2 * 4 * 3 * 2
    regions = []
    for layer in range(lay.num_kda_layers):
        regions.append((lay.recurrent_offset(layer), lay.recurrent_bytes))
        regions.append((lay.conv_offset(layer), lay.conv_bytes))
    regions.sort()
    for (a, na), (b, _) in zip(regions, regions[1:], strict=False):
        assert a % ALIGN == 0 and a + na <= b
    last, n = regions[-1]
    assert last % ALIGN == 0 and last + n <= lay.state_block_bytes
    assert lay.state_block_bytes % ALIGN == 0
    with pytest.raises(IndexError):
        lay.conv_offset(3)


def test_kv_rows_and_pages() -> None:
    lay = small(page_size=4)
    assert lay.kv_token_bytes == 2 * 6 * 2
    assert [lay.kv_offset(i) for i in range(2)] == [0, 12]
    assert lay.page_bytes == 4 * lay.kv_token_bytes


def test_geometry_puts_the_top_state_slot_at_the_end() -> None:
    lay = small(page_size=2)
    g = lay.geometry(100_000)
    assert g.total_bytes % ALIGN == 0 and g.total_bytes <= 100_000
    assert g.state_offset(g.num_state_slots - 1) + g.state_block_bytes == g.total_bytes
    assert g.state_base >= 0 and g.state_base % ALIGN == 0 and g.state_base < g.state_block_bytes
    assert g.num_pages * g.page_bytes <= g.total_bytes < (g.num_pages + 1) * g.page_bytes + ALIGN
    assert g.num_token_slots == 2 * g.num_pages
    with pytest.raises(ValueError):
        lay.geometry(lay.state_block_bytes - 1)


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(ValueError):
        small(kda_heads=0)
    with pytest.raises(ValueError):
        small(conv_kernel=1)


def test_true_size_presets() -> None:
    from radixk3.config import preset

    kl = PoolLayout.from_config(preset("kimi-linear-48b"))
    # 20 KDA layers x (32x128x128 fp32 + 3*4096 x 3 bf16) and 7 MLA layers x 576 bf16 per token.
    assert kl.num_kda_layers == 20 and kl.num_mla_layers == 7 and kl.kv_dtype == "bfloat16"
    assert kl.state_payload_bytes == 20 * (2 * 2**20 + 3 * 4096 * 3 * 2)
    assert kl.kv_token_bytes == 7 * 576 * 2
    # vLLM's hybrid block: one KDA layer's state in pages of one MLA layer, "about 1,900 tokens".
    assert kl.state_equivalent_tokens() == 1885

    k3 = PoolLayout.from_config(preset("kimi-k3"), tp=8)
    assert k3.kda_heads == 12
    assert 53 * 2**20 < k3.state_block_bytes < 55 * 2**20  # "about 54 MB per state"
    assert k3.kv_token_bytes == 24 * 576 * 2  # "about 27 KB per token"
    assert 1900 < k3.state_block_bytes / k3.kv_token_bytes < 2100  # "~2,000 tokens of KV"
    with pytest.raises(ValueError):
        PoolLayout.from_config(preset("kimi-k3"), tp=5)
