"""Hypothesis property tests over random lengths, batch mixes, slot assignments and checkpoint offsets
(derandomized: the same examples every run). Triton runs under the interpreter at tiny sizes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kda_inputs import kda_inputs

from kernels.backend import ENV_VAR
from kernels.conv1d import causal_conv1d
from kernels.conv1d_pool import conv1d_prefill
from kernels.kda import kda_recurrent
from kernels.kda_pool import kda_decode, kda_prefill, kda_replay
from kernels.mla_paged import mla_paged_prefill, mla_store
from kernels.paged_kv import PagedKV, paged_slots
from kernels.state_checkpoints import StateCheckpoints

H, K, V = 2, 16, 8
SETTINGS = {"deadline": None, "derandomize": True}


@contextmanager
def kernels_backend(name: str) -> Iterator[None]:
    old = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ[ENV_VAR]
        else:
            os.environ[ENV_VAR] = old


Batch = tuple[list[int], list[int], list[bool], list[tuple[int, int]]]


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


@st.composite
def batches(draw: st.DrawFn, max_len: int, max_seqs: int) -> Batch:
    """(lengths, distinct slots, has-initial flags, (seq, offset) checkpoints)."""
    lens = draw(st.lists(st.integers(0, max_len), min_size=1, max_size=max_seqs))
    n = len(lens)
    slots = draw(st.permutations(list(range(2 * max_seqs))))[:n]
    has_init = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    cks = draw(st.lists(st.tuples(st.integers(0, n - 1), st.floats(0, 1)), max_size=4))
    pairs = sorted({(s, round(f * lens[s])) for s, f in cks})
    return lens, slots, has_init, pairs


def check_kda_prefill(lens: list[int], slots: list[int], has_init: list[bool], pairs: list[tuple[int, int]],
                      atol: float) -> None:  # fmt: skip
    x = kda_inputs(lens, H, K, V, seed=sum(lens) + len(pairs))
    num_slots = 2 * 4 + len(pairs)
    pool = torch.randn(num_slots, H, K, V, generator=torch.Generator().manual_seed(len(lens)))
    init = torch.where(torch.tensor(has_init).view(-1, 1, 1, 1), pool[slots], 0.0)
    ck_slots = list(range(8, 8 + len(pairs)))
    ck = StateCheckpoints(
        torch.tensor([s for s, _ in pairs], dtype=torch.int64),
        torch.tensor([p for _, p in pairs], dtype=torch.int64),
        torch.tensor(ck_slots, dtype=torch.int64),
    )
    o = kda_prefill(x.q, x.k, x.v, x.g, x.beta, pool, state_slots=torch.tensor(slots), cu_seqlens=x.cu_seqlens,
                    has_initial_state=torch.tensor(has_init), checkpoints=ck)  # fmt: skip
    b = x.cu_seqlens.tolist()
    for i in range(len(lens)):
        sl = slice(b[i], b[i + 1])
        o_ref, s_ref = kda_recurrent(x.q[sl], x.k[sl], x.v[sl], x.g[sl], x.beta[sl], initial_state=init[i : i + 1])
        assert maxdiff(o[sl], o_ref) <= atol
        assert maxdiff(pool[slots[i]], s_ref[0]) <= atol
    for (seq, off), slot in zip(pairs, ck_slots, strict=True):
        sl = slice(b[seq], b[seq] + off)
        _, s_ref = kda_recurrent(x.q[sl], x.k[sl], x.v[sl], x.g[sl], x.beta[sl], initial_state=init[seq : seq + 1])
        assert maxdiff(pool[slot], s_ref[0]) <= atol


@settings(max_examples=25, **SETTINGS)
@given(batches(max_len=150, max_seqs=4))
def test_kda_prefill_torch(batch: Batch) -> None:
    with kernels_backend("torch"):
        check_kda_prefill(*batch, atol=1e-5)


@settings(max_examples=4, **SETTINGS)
@given(batches(max_len=20, max_seqs=2))
def test_kda_prefill_triton(batch: Batch) -> None:
    with kernels_backend("triton"):
        check_kda_prefill(*batch, atol=1e-4)


@settings(max_examples=20, **SETTINGS)
@given(batches(max_len=12, max_seqs=4), st.sampled_from(["torch", "triton"]))
def test_conv_prefill(batch: Batch, backend: str) -> None:
    lens, slots, has_init, pairs = batch
    c, w = 6, 4
    gen = torch.Generator().manual_seed(sum(lens))
    x = torch.randn(sum(lens), c, generator=gen)
    weight = torch.randn(c, w, generator=gen)
    pool = torch.randn(8 + len(pairs), c, w - 1, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    init = torch.where(torch.tensor(has_init).view(-1, 1, 1), pool[slots], 0.0)
    ck_slots = list(range(8, 8 + len(pairs)))
    ck = StateCheckpoints(
        *(torch.tensor(v, dtype=torch.int64) for v in ([s for s, _ in pairs], [p for _, p in pairs], ck_slots))
    )
    with kernels_backend(backend):
        y = conv1d_prefill(x, weight, pool, state_slots=torch.tensor(slots), cu_seqlens=cu,
                           has_initial_state=torch.tensor(has_init), checkpoints=ck)  # fmt: skip
    y_ref, final = causal_conv1d(x, weight, cu_seqlens=cu, initial_state=init)
    assert maxdiff(y, y_ref) <= 1e-5
    assert torch.equal(pool[slots], final)
    b = cu.tolist()
    for (seq, off), slot in zip(pairs, ck_slots, strict=True):
        _, part = causal_conv1d(x[b[seq] : b[seq] + off], weight, initial_state=init[seq : seq + 1])
        assert torch.equal(pool[slot], part[0])


@settings(max_examples=15, **SETTINGS)
@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=4),
    st.permutations(list(range(6))),
    st.sampled_from(["torch", "triton"]),
)
def test_replay_equals_decode(counts: list[int], perm: list[int], backend: str) -> None:
    n, length = len(counts), 5
    gen = torch.Generator().manual_seed(sum(counts) * 7 + n)
    k, g = torch.randn(n, length, H, K, generator=gen), torch.randn(n, length, H, K, generator=gen)
    v, beta = torch.randn(n, length, H, V, generator=gen), torch.randn(n, length, H, generator=gen)
    q = torch.randn(n, length, H, K, generator=gen)
    slots = torch.tensor(perm[:n])
    pool = torch.randn(6, H, K, V, generator=gen)
    flags = {"beta_logits": True, "qk_l2norm": True}
    with kernels_backend(backend):
        decoded = pool.clone()
        for t in range(length):
            live = [i for i in range(n) if counts[i] > t]
            if live:
                kda_decode(q[live, t], k[live, t], v[live, t], g[live, t].clamp(max=0), beta[live, t], decoded,
                           slots[live], **flags)  # fmt: skip
        replayed = pool.clone()
        kda_replay(k, v, g.clamp(max=0), beta, replayed, slots, torch.tensor(counts), **flags)
    assert torch.equal(replayed, decoded)


@settings(max_examples=15, **SETTINGS)
@given(
    st.lists(st.tuples(st.integers(1, 20), st.floats(0, 1)), min_size=1, max_size=3),
    st.sampled_from([1, 2, 8]),
    st.integers(0, 1000),
    st.sampled_from(["torch", "triton"]),
)
def test_mla_paged_prefill(seqs: list[tuple[int, float]], page_size: int, seed: int, backend: str) -> None:
    from test_mla import DN, DR, DV, R, dense
    from test_mla import H as MH

    kv_lens = [n for n, _ in seqs]
    q_lens = [max(1, round(f * n)) for n, f in seqs]
    gen = torch.Generator().manual_seed(seed)
    pages = [(n + page_size - 1) // page_size for n in kv_lens]
    order = torch.randperm(sum(pages), generator=gen)
    table = torch.zeros(len(seqs), max(pages), dtype=torch.int64)
    used = 0
    for i, p in enumerate(pages):
        table[i, :p] = order[used : used + p]
        used += p
    kv = PagedKV(table, torch.tensor(kv_lens), page_size)
    buf = torch.zeros(sum(pages) * page_size, R + DR)
    lats = [torch.randn(n, R + DR, generator=gen) for n in kv_lens]
    w = torch.randn(MH * (DN + DV), R, generator=gen) / R**0.5
    t = sum(q_lens)
    q_nope, q_pe = torch.randn(t, MH, DN, generator=gen), torch.randn(t, MH, DR, generator=gen)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    scale = (DN + DR) ** -0.5
    with kernels_backend(backend):
        for i, lat in enumerate(lats):
            pos = torch.arange(len(lat))
            mla_store(buf, paged_slots(table, torch.full_like(pos, i), pos, page_size), lat)
        o = mla_paged_prefill(q_nope, q_pe, buf, w, kv, cu_q=cu_q, scale=scale)
    for i in range(len(seqs)):
        sl = slice(int(cu_q[i]), int(cu_q[i + 1]))
        assert (o[sl] - dense(q_nope[sl], q_pe[sl], lats[i], w, scale)).abs().max().item() <= 1e-4
