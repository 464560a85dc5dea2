"""MLA over a paged latent buffer on both backends: store, prefill with a cached prefix, absorbed decode,
against dense attention over the gathered KV."""

from __future__ import annotations

import pytest
import torch
from test_mla import DN, DR, DV, H, R, dense

from kernels.backend import ENV_VAR
from kernels.mla_paged import mla_paged_decode, mla_paged_prefill, mla_store
from kernels.paged_kv import PagedKV, paged_slots

SCALE = (DN + DR) ** -0.5


def tol(backend: str) -> float:
    return 1e-5 if backend == "torch" else 1e-4


def paged_setup(kv_lens: list[int], page_size: int, seed: int) -> tuple[PagedKV, torch.Tensor, list[torch.Tensor]]:
    """Pages handed out in a shuffled order; returns the table, an empty buffer and each sequence's latent."""
    gen = torch.Generator().manual_seed(seed)
    pages = [(n + page_size - 1) // page_size for n in kv_lens]
    order = torch.randperm(sum(pages) + 3, generator=gen)
    table = torch.zeros(len(kv_lens), max(pages), dtype=torch.int64)
    used = 0
    for i, p in enumerate(pages):
        table[i, :p] = order[used : used + p]
        used += p
    buf = torch.full(((sum(pages) + 3) * page_size, R + DR), float("nan"))  # unused slots hold NaN
    lats = [torch.randn(n, R + DR, generator=gen) for n in kv_lens]
    return PagedKV(table, torch.tensor(kv_lens), page_size), buf, lats


def store_all(kv: PagedKV, buf: torch.Tensor, lats: list[torch.Tensor]) -> None:
    for i, lat in enumerate(lats):
        pos = torch.arange(len(lat))
        mla_store(buf, paged_slots(kv.block_table, torch.full_like(pos, i), pos, kv.page_size), lat)


def weights(seed: int) -> torch.Tensor:
    return torch.randn(H * (DN + DV), R, generator=torch.Generator().manual_seed(seed)) / R**0.5


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefill_over_cached_prefix(backend: str, page_size: int) -> None:
    kv_lens, q_lens = [9, 3, 20], [4, 3, 1]
    kv, buf, lats = paged_setup(kv_lens, page_size, 0)
    store_all(kv, buf, lats)
    gen = torch.Generator().manual_seed(1)
    t = sum(q_lens)
    q_nope, q_pe = torch.randn(t, H, DN, generator=gen), torch.randn(t, H, DR, generator=gen)
    w = weights(2)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    o = mla_paged_prefill(q_nope, q_pe, buf, w, kv, cu_q=cu_q, scale=SCALE)
    for i in range(len(kv_lens)):
        sl = slice(int(cu_q[i]), int(cu_q[i + 1]))
        ref = dense(q_nope[sl], q_pe[sl], lats[i], w, SCALE)
        torch.testing.assert_close(o[sl], ref, rtol=0, atol=tol(backend))


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_absorbed(backend: str, page_size: int) -> None:
    kv_lens = [1, 17, 40]
    kv, buf, lats = paged_setup(kv_lens, page_size, 3)
    store_all(kv, buf, lats)
    gen = torch.Generator().manual_seed(4)
    q_nope, q_pe = torch.randn(3, H, DN, generator=gen), torch.randn(3, H, DR, generator=gen)
    w = weights(5)
    o = mla_paged_decode(q_nope, q_pe, buf, w, kv, scale=SCALE)
    for i in range(3):
        ref = dense(q_nope[i : i + 1], q_pe[i : i + 1], lats[i], w, SCALE)
        torch.testing.assert_close(o[i : i + 1], ref, rtol=0, atol=tol(backend))


def test_store_writes_only_its_slots(backend: str) -> None:
    buf = torch.zeros(10, R + DR)
    rows = torch.randn(3, R + DR)
    mla_store(buf, torch.tensor([7, 2, 4]), rows)
    assert torch.equal(buf[[7, 2, 4]], rows)
    assert torch.equal(buf[[0, 1, 3, 5, 6, 8, 9]], torch.zeros(7, R + DR))
    with pytest.raises(ValueError, match="repeat"):
        mla_store(buf, torch.tensor([1, 1]), rows[:2])


def test_triton_equals_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    kv, buf, lats = paged_setup([6, 11], 2, 6)
    store_all(kv, buf, lats)
    gen = torch.Generator().manual_seed(7)
    q_nope, q_pe = torch.randn(5, H, DN, generator=gen), torch.randn(5, H, DR, generator=gen)
    cu_q = torch.tensor([0, 2, 5])
    outs = []
    for be in ("torch", "triton"):
        monkeypatch.setenv(ENV_VAR, be)
        outs.append(mla_paged_prefill(q_nope, q_pe, buf, weights(8), kv, cu_q=cu_q, scale=SCALE))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-4)


def test_short_tables_are_refused() -> None:
    kv = PagedKV(torch.zeros(1, 1, dtype=torch.int64), torch.tensor([5]), 4)
    with pytest.raises(ValueError, match="pages"):
        mla_paged_decode(
            torch.zeros(1, H, DN), torch.zeros(1, H, DR), torch.zeros(8, R + DR), weights(0), kv, scale=1.0
        )
