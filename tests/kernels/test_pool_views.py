"""Every pool op in place on the real pool buffer's per-layer views (strided slots / rows), on both backends,
against the torch path on contiguous copies of those views; every byte of the buffer outside the slots (or KV
rows) of the targeted layer stays as it was. Triton also runs on the contiguous copies: strided or not, the
same bits."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from kernels.backend import ENV_VAR
from kernels.conv1d_pool import conv1d_decode, conv1d_prefill, conv1d_replay
from kernels.kda import KDAGate, l2norm
from kernels.kda_pool import kda_decode, kda_prefill, kda_replay
from kernels.mla_paged import mla_paged_decode, mla_paged_prefill, mla_store
from kernels.paged_kv import PagedKV, paged_slots
from kernels.state_checkpoints import StateCheckpoints
from runtime.pool_layout import PoolLayout, dtype_bytes
from runtime.worker.pool_buffer import PoolBuffer

H, D, CONV = 2, 16, 4
R, DR, MH, DN, DV = 16, 8, 2, 8, 8  # kv_dim = R + DR = 24
LAYER = 1  # the targeted layer; layer 0's bytes sit in between and must stay as they were
POOL_BYTES = 64 << 10
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
Op = Callable[[list[Tensor]], list[Tensor]]


def make_pool(kv_dtype: torch.dtype, page_size: int = 1, seed: int = 0) -> PoolBuffer:
    """A small pool whose every byte is random garbage (NaN and inf patterns included)."""
    layout = PoolLayout(
        num_kda_layers=2, kda_heads=H, head_dim=D, conv_kernel=CONV, num_mla_layers=2, kv_dim=R + DR,
        kv_dtype=str(kv_dtype).removeprefix("torch."), page_size=page_size,
    )  # fmt: skip
    pb = PoolBuffer(layout, POOL_BYTES)
    gen = torch.Generator().manual_seed(seed)
    pb.data.copy_(torch.randint(0, 256, pb.data.shape, generator=gen, dtype=torch.uint8))
    return pb


def spans_mask(pb: PoolBuffer, spans: list[tuple[int, int]]) -> Tensor:
    mask = torch.zeros_like(pb.data, dtype=torch.bool)
    for start, size in spans:
        mask[start : start + size] = True
    return mask


def recurrent_spans(pb: PoolBuffer, slots: list[int]) -> list[tuple[int, int]]:
    lay, g = pb.layout, pb.geometry
    return [(g.state_offset(s) + lay.recurrent_offset(LAYER), lay.recurrent_bytes) for s in slots]


def conv_spans(pb: PoolBuffer, slots: list[int]) -> list[tuple[int, int]]:
    lay, g = pb.layout, pb.geometry
    return [(g.state_offset(s) + lay.conv_offset(LAYER), lay.conv_bytes) for s in slots]


def kv_spans(pb: PoolBuffer, rows: list[int]) -> list[tuple[int, int]]:
    lay = pb.layout
    width = lay.kv_dim * dtype_bytes(lay.kv_dtype)
    return [(r * lay.kv_token_bytes + lay.kv_offset(LAYER), width) for r in rows]


def close(a: Tensor, b: Tensor, atol: float) -> None:
    """Bit-equal for atol 0 (NaN and signed zeros included), else within atol."""
    assert a.shape == b.shape and a.dtype == b.dtype
    if atol == 0:
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    elif a.numel():
        err = (a.float() - b.float()).abs().max().item()
        assert err <= atol, err


def run_in_place(
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
    pb: PoolBuffer,
    views: list[Tensor],
    op: Op,
    targets: list[tuple[int, list[int]]],
    spans: list[tuple[int, int]],
    atol: float = 1e-4,
) -> None:
    """Run `op` on the views; compare with torch on contiguous copies (and Triton on them, bit for bit): its
    outputs and rows `targets` = (view index, rows written). Bytes outside `spans` must be untouched."""
    assert all(not v.is_contiguous() for v in views)  # the point: slot stride > slot size
    before = pb.data.clone()
    copies = {}
    for be in {"torch", backend}:
        monkeypatch.setenv(ENV_VAR, be)
        dense = [v.clone(memory_format=torch.contiguous_format) for v in views]
        copies[be] = (op(dense), dense)
    monkeypatch.setenv(ENV_VAR, backend)
    outs = op(views)
    for be, (ref_outs, dense) in copies.items():
        tol = 0.0 if be == backend else atol
        for a, b in zip(outs, ref_outs, strict=True):
            close(a, b, tol)
        for i, rows in targets:
            close(views[i][rows], dense[i][rows], tol)
    outside = ~spans_mask(pb, spans)
    assert torch.equal(pb.data[outside], before[outside])


def kda_inputs(t: int, seed: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k = (l2norm(torch.randn(t, H, D, generator=gen)) for _ in range(2))
    v = torch.randn(t, H, D, generator=gen)
    g = -torch.rand(t, H, D, generator=gen)
    beta = torch.rand(t, H, generator=gen)
    return [q, k, v, g, beta]


def fill(view: Tensor, slots: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    view[slots] = torch.randn(len(slots), *view.shape[1:], generator=gen).to(view.dtype)


# checkpoints of two sequences of 5 and 21 tokens: at 0, inside, at and across Triton's 16-token segments, at
# the full length
LENS = [5, 21]
CK = StateCheckpoints(torch.tensor([0, 0, 0, 1, 1, 1, 1]), torch.tensor([0, 3, 5, 0, 16, 17, 21]), torch.tensor([]))


def checkpoints(slots: list[int]) -> StateCheckpoints:
    return CK._replace(slot=torch.tensor(slots))


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("commit", [True, False])
def test_kda_prefill(backend: str, monkeypatch: pytest.MonkeyPatch, kv_dtype: torch.dtype, commit: bool) -> None:
    pb = make_pool(kv_dtype)
    rec = pb.recurrent_state(LAYER)
    n = rec.shape[0]
    live, ck_slots = [n - 1, 2], [0, 5, n - 3, 1, 3, 4, n - 2]
    fill(rec, [live[0]], 1)
    rec[live[1]] = float("nan")  # a fresh sequence: has_initial_state False, whatever its slot holds
    x = kda_inputs(sum(LENS), 2)
    cu = torch.tensor([0, LENS[0], sum(LENS)])

    def op(v: list[Tensor]) -> list[Tensor]:
        o = kda_prefill(
            *x, v[0], state_slots=torch.tensor(live), cu_seqlens=cu, has_initial_state=torch.tensor([True, False]),
            checkpoints=checkpoints(ck_slots), commit=commit,
        )  # fmt: skip
        return [o]

    written = ck_slots + (live if commit else [])
    run_in_place(backend, monkeypatch, pb, [rec], op, [(0, written)], recurrent_spans(pb, written))


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_kda_decode_and_replay(backend: str, monkeypatch: pytest.MonkeyPatch, kv_dtype: torch.dtype) -> None:
    pb = make_pool(kv_dtype, seed=3)
    rec = pb.recurrent_state(LAYER)
    slots = [rec.shape[0] - 1, 0, 4]
    fill(rec, slots, 4)
    gen = torch.Generator().manual_seed(5)
    raw = [torch.randn(3, 2, H, D, generator=gen) for _ in range(4)] + [torch.randn(3, 2, H, generator=gen)]
    gate = KDAGate(torch.randn(H, generator=gen), torch.randn(H * D, generator=gen))
    flags = {"gate": gate, "beta_logits": True, "qk_l2norm": True}

    def op(v: list[Tensor]) -> list[Tensor]:
        o = kda_decode(*(z[:, 0] for z in raw), v[0], torch.tensor(slots), **flags)
        kda_replay(*raw[1:], v[0], torch.tensor(slots), torch.tensor([2, 0, 1]), **flags)
        return [o]

    run_in_place(backend, monkeypatch, pb, [rec], op, [(0, slots)], recurrent_spans(pb, slots))


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("commit", [True, False])
def test_conv1d_prefill(backend: str, monkeypatch: pytest.MonkeyPatch, kv_dtype: torch.dtype, commit: bool) -> None:
    pb = make_pool(kv_dtype, seed=6)
    conv = pb.conv_state(LAYER)
    n = conv.shape[0]
    live, ck_slots = [1, n - 1], [0, 5, n - 3, 2, 3, 4, n - 2]
    fill(conv, [live[0]], 7)
    conv[live[1]] = float("nan")
    gen = torch.Generator().manual_seed(8)
    c = conv.shape[1]
    x = torch.randn(sum(LENS), c, generator=gen).to(kv_dtype)
    w = torch.randn(c, CONV, generator=gen)
    cu = torch.tensor([0, LENS[0], sum(LENS)])

    def op(v: list[Tensor]) -> list[Tensor]:
        y = conv1d_prefill(
            x, w, v[0], state_slots=torch.tensor(live), cu_seqlens=cu, has_initial_state=torch.tensor([True, False]),
            checkpoints=checkpoints(ck_slots), commit=commit,
        )  # fmt: skip
        return [y]

    written = ck_slots + (live if commit else [])
    run_in_place(backend, monkeypatch, pb, [conv], op, [(0, written)], conv_spans(pb, written), atol=2e-2)


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_conv1d_decode_and_replay(backend: str, monkeypatch: pytest.MonkeyPatch, kv_dtype: torch.dtype) -> None:
    pb = make_pool(kv_dtype, seed=9)
    conv = pb.conv_state(LAYER)
    slots = [conv.shape[0] - 1, 0, 3]
    fill(conv, slots, 10)
    gen = torch.Generator().manual_seed(11)
    c = conv.shape[1]
    x = torch.randn(3, 5, c, generator=gen).to(kv_dtype)
    w = torch.randn(c, CONV, generator=gen)

    def op(v: list[Tensor]) -> list[Tensor]:
        y = conv1d_decode(x[:, 0], w, v[0], torch.tensor(slots))
        conv1d_replay(x[:, 1:], v[0], torch.tensor(slots), torch.tensor([4, 0, 2]))
        return [y]

    run_in_place(backend, monkeypatch, pb, [conv], op, [(0, slots)], conv_spans(pb, slots), atol=2e-2)


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_mla_store_prefill_decode(
    backend: str, monkeypatch: pytest.MonkeyPatch, kv_dtype: torch.dtype, page_size: int
) -> None:
    """Two sequences with cached prefixes of 6 and 0 tokens store their new tokens (3 and 5), attend over prefix
    + new tokens (prefill), store one more token each and decode it. Pages shuffled among the first 24."""
    pb = make_pool(kv_dtype, page_size, seed=12)
    kv = pb.kv(LAYER)
    gen = torch.Generator().manual_seed(13)
    prefix, new = [6, 0], [3, 5]
    total = [p + q + 1 for p, q in zip(prefix, new, strict=True)]
    pages_per_seq = -(-max(total) // page_size)
    table = torch.randperm(24, generator=gen)[: 2 * pages_per_seq].view(2, pages_per_seq)

    def rows(seq: int, start: int, stop: int) -> Tensor:
        pos = torch.arange(start, stop)
        return paged_slots(table, torch.full_like(pos, seq), pos, page_size)

    cached = torch.cat([rows(i, 0, prefix[i]) for i in range(2)])
    kv[cached] = torch.randn(len(cached), R + DR, generator=gen).to(kv_dtype)
    new_rows = torch.cat([rows(i, prefix[i], prefix[i] + new[i]) for i in range(2)])
    step_rows = torch.cat([rows(i, total[i] - 1, total[i]) for i in range(2)])
    lat_new = torch.randn(sum(new), R + DR, generator=gen)
    lat_step = torch.randn(2, R + DR, generator=gen)
    t = sum(new)
    q_nope, q_pe = torch.randn(t + 2, MH, DN, generator=gen), torch.randn(t + 2, MH, DR, generator=gen)
    w = torch.randn(MH * (DN + DV), R, generator=gen) / R**0.5
    cu_q = torch.tensor([0, new[0], t])
    scale = (DN + DR) ** -0.5

    def op(v: list[Tensor]) -> list[Tensor]:
        mla_store(v[0], new_rows, lat_new)
        pre = PagedKV(table, torch.tensor([p + q for p, q in zip(prefix, new, strict=True)]), page_size)
        o = mla_paged_prefill(q_nope[:t], q_pe[:t], v[0], w, pre, cu_q=cu_q, scale=scale)
        mla_store(v[0], step_rows, lat_step)
        step = PagedKV(table, torch.tensor(total), page_size)
        od = mla_paged_decode(q_nope[t:], q_pe[t:], v[0], w, step, scale=scale)
        return [o, od]

    written = torch.cat([new_rows, step_rows]).tolist()
    run_in_place(backend, monkeypatch, pb, [kv], op, [(0, written)], kv_spans(pb, written))


def test_inner_dims_must_be_contiguous(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton kernels take any slot stride, but each slot must be contiguous, and slots must not overlap."""
    monkeypatch.setenv(ENV_VAR, "triton")
    x = kda_inputs(3, 14)
    slots = torch.tensor([0])
    pool = torch.zeros(4, H, D, 2 * D)[..., :D]  # rows of a slot strided
    with pytest.raises(ValueError, match="contiguous"):
        kda_decode(*(z[:1] for z in x[:4]), x[4][:1], pool, slots)
    overlapping = torch.zeros(H * D * D + 3 * 8).as_strided((4, H, D, D), (8, D * D, D, 1))
    with pytest.raises(ValueError, match="overlap"):
        kda_decode(*(z[:1] for z in x[:4]), x[4][:1], overlapping, slots)
    conv = torch.zeros(4, 3 * CONV, 2 * (CONV - 1))[..., : CONV - 1]
    with pytest.raises(ValueError, match="contiguous"):
        conv1d_decode(torch.zeros(1, 3 * CONV), torch.zeros(3 * CONV, CONV), conv, slots)
    latent = torch.zeros(2 * (R + DR), 8).T  # [8, 2(R+DR)] with column-major rows
    with pytest.raises(ValueError, match="contiguous|shape"):
        mla_store(latent[:, : R + DR], slots, torch.zeros(1, R + DR))


HOST_READS = ("tolist", "item", "__bool__", "__int__", "__index__")


def count_host_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every read of a tensor's values into Python (a device sync on a GPU) from here on."""
    seen: list[str] = []
    for name in HOST_READS:
        orig = getattr(torch.Tensor, name)

        def spy(self: Tensor, *a: object, _orig: Callable[..., object] = orig, _name: str = name) -> object:
            seen.append(_name)
            return _orig(self, *a)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return seen


def test_validate_false_skips_host_reads(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-layer decode ops with validate=False read nothing back on the Triton path (what a GPU runs);
    results equal validate=True's bit for bit on both backends."""
    pb = make_pool(torch.bfloat16, 4, seed=15)
    rec, conv, kv = pb.recurrent_state(LAYER), pb.conv_state(LAYER), pb.kv(LAYER)
    slots = torch.tensor([rec.shape[0] - 1, 1])
    fill(rec, slots.tolist(), 16)
    fill(conv, slots.tolist(), 17)
    x = kda_inputs(2, 18)
    gen = torch.Generator().manual_seed(19)
    xc = torch.randn(2, conv.shape[1], generator=gen).to(conv.dtype)
    wc = torch.randn(conv.shape[1], CONV, generator=gen)
    table = torch.tensor([[3, 5], [0, 7]])
    paged = PagedKV(table, torch.tensor([6, 2]), 4)
    kv[paged_slots(table, torch.tensor([0] * 6 + [1] * 2), torch.tensor([*range(6), 0, 1]), 4)] = torch.randn(
        8, R + DR, generator=gen
    ).to(kv.dtype)
    lat = torch.randn(2, R + DR, generator=gen)
    store_rows = paged_slots(table, torch.tensor([0, 1]), torch.tensor([5, 1]), 4)
    q_nope, q_pe = torch.randn(2, MH, DN, generator=gen), torch.randn(2, MH, DR, generator=gen)
    w = torch.randn(MH * (DN + DV), R, generator=gen) / R**0.5

    def step(validate: bool) -> list[Tensor]:
        o = kda_decode(*x, rec, slots, validate=validate)
        y = conv1d_decode(xc, wc, conv, slots, validate=validate)
        mla_store(kv, store_rows, lat, validate=validate)
        od = mla_paged_decode(q_nope, q_pe, kv, w, paged, scale=0.3, validate=validate)
        return [o, y, od]

    before = pb.data.clone()
    seen = count_host_reads(monkeypatch)
    checked = step(True)
    assert seen  # the checks do read the slots
    seen.clear()
    after = pb.data.clone()
    pb.data.copy_(before)
    unchecked = step(False)
    if backend == "triton":
        assert seen == []
    for a, b in zip(checked, unchecked, strict=True):
        close(a, b, 0.0)
    assert torch.equal(pb.data, after)


def test_store_refuses_rows_outside_the_buffer() -> None:
    """The Triton store does not bound its writes: the check (once per step, or per call) does."""
    with pytest.raises(ValueError, match="outside"):
        mla_store(torch.zeros(4, R + DR), torch.tensor([4]), torch.zeros(1, R + DR))
