"""The fused in-place KDA decode on CPU (`kernels.kda_decode_cpu`) against the torch path it replaces (its
oracle, `RADIXK3_FUSED_KDA=0`): the same bits, in the outputs and in every state of the pool, over head shapes
that take both of torch's column-sum orders and its deeper cascade, batch sizes 1 to 32 (9 for the larger heads),
a pool whose slots lie further apart than a slot (the pool buffer's per-layer views), and rows sharing one scratch
slot (the decode graph's padding)."""

from __future__ import annotations

import platform

import pytest
import torch
from torch import Tensor

from kernels import kda_decode_cpu as fused
from kernels.kda import KDAGate, l2norm
from kernels.kda_pool import kda_decode, kda_verify_padded

SLOTS = 40
X86 = platform.machine().lower() in ("x86_64", "amd64")
pytestmark = pytest.mark.skipif(not X86, reason="the fused op matches torch's sum order on x86 only")


def test_builds_here() -> None:
    """On x86 with a compiler (CI included) the op must build: a silent fallback would leave it untested."""
    assert fused.available()


def _pool(h: int, kdim: int, vdim: int, gen: torch.Generator) -> Tensor:
    """A [SLOTS, h, kdim, vdim] fp32 view whose slots lie 7 floats more than a slot apart; the gaps hold NaN."""
    slot = h * kdim * vdim
    flat = torch.full((SLOTS * (slot + 7),), float("nan"))
    pool = flat.as_strided((SLOTS, h, kdim, vdim), (slot + 7, kdim * vdim, vdim, 1))
    pool.copy_(torch.randn(SLOTS, h, kdim, vdim, generator=gen))
    return pool


def _inputs(n: int, h: int, kdim: int, vdim: int, gen: torch.Generator, raw: bool) -> list[Tensor]:
    """q, k, v, g, beta for n sequences: raw projections (gate logits, beta logits) or prepared ones."""
    q, k = (torch.randn(n, h, kdim, generator=gen) for _ in range(2))
    v = torch.randn(n, h, vdim, generator=gen)
    if raw:
        return [q, k, v, torch.randn(n, h, kdim, generator=gen), torch.randn(n, h, generator=gen)]
    g = -torch.rand(n, h, kdim, generator=gen) * torch.rand(n, h, 1, generator=gen) * 4
    return [l2norm(q), l2norm(k), v, g, torch.rand(n, h, generator=gen)]


def _both(monkeypatch: pytest.MonkeyPatch, pool: Tensor, slots: Tensor, x: list[Tensor],
          **flags: object) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(fused o, fused pool, torch o, torch pool) from the same pool and inputs."""
    ref = pool.clone()
    monkeypatch.setenv(fused.ENV_VAR, "0")
    o_ref = kda_decode(*x, ref, slots, **flags)  # type: ignore[arg-type]
    monkeypatch.setenv(fused.ENV_VAR, "1")
    assert fused.available() and fused.fusable(pool, slots)
    o = kda_decode(*x, pool, slots, **flags)  # type: ignore[arg-type]
    return o, pool, o_ref, ref


@pytest.mark.parametrize(("h", "kdim", "vdim"), [(8, 64, 64), (2, 32, 32), (3, 16, 16), (1, 128, 128),
                                                 (2, 48, 40), (1, 300, 36)])
def test_fused_decode_is_the_torch_step(monkeypatch: pytest.MonkeyPatch, h: int, kdim: int, vdim: int) -> None:
    gen = torch.Generator().manual_seed(h * 1000 + kdim + vdim)
    for n in (1, 3, 32 if kdim * vdim <= 32 * 32 else 9):
        pool = _pool(h, kdim, vdim, gen)
        slots = torch.randperm(SLOTS, generator=gen)[:n]
        raw = n == 3  # once with the in-kernel gate, beta sigmoid and L2 norms
        flags = {"gate": KDAGate(torch.randn(h, generator=gen), torch.randn(h * kdim, generator=gen)),
                 "beta_logits": True, "qk_l2norm": True} if raw else {}
        for _ in range(3):  # a few steps: the state the op wrote is the one it reads next
            x = _inputs(n, h, kdim, vdim, gen, raw)
            o, got, o_ref, want = _both(monkeypatch, pool, slots, x, **flags)
            assert torch.equal(o, o_ref), (n, (o - o_ref).abs().max())
            assert torch.equal(got, want)  # every slot: the untouched ones too
            pool = got


def test_rows_sharing_a_scratch_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Padding rows all name one scratch slot: the real rows are exact, the scratch slot takes the first padding
    row's update (no two threads write it), and the other slots are untouched."""
    h, kdim, vdim, scratch = 4, 32, 32, SLOTS - 1
    gen = torch.Generator().manual_seed(3)
    pool = _pool(h, kdim, vdim, gen)
    slots = torch.tensor([5, 0, 17, scratch, scratch, scratch, scratch, scratch])
    x = _inputs(len(slots), h, kdim, vdim, gen, raw=False)
    before = pool.clone()
    o, got, o_ref, want = _both(monkeypatch, pool, slots, x, validate=False)  # as the decode graph calls it
    assert torch.equal(o[:3], o_ref[:3]) and bool(o.isfinite().all())
    assert torch.equal(got[:scratch], want[:scratch])
    monkeypatch.setenv(fused.ENV_VAR, "0")
    o_first = kda_decode(*(t[:4] for t in x), before, slots[:4])  # the real rows and the first padding row
    assert torch.equal(o[3], o_first[3]) and torch.equal(got[scratch], before[scratch])


@pytest.mark.parametrize(("h", "kdim", "vdim"), [(8, 64, 64), (2, 48, 40)])
def test_fused_verify_is_the_torch_loop(monkeypatch: pytest.MonkeyPatch, h: int, kdim: int, vdim: int) -> None:
    """A verify window (3 sequences of 4 positions, one padded after 2 with the zero inputs the backend pads
    with): the same outputs and snapshots, bit for bit, and the live states untouched."""
    gen = torch.Generator().manual_seed(kdim)
    n, w = 3, 4
    pool = _pool(h, kdim, vdim, gen)
    slots = torch.tensor([7, 0, 21])
    x = [t.view(n, w, *t.shape[1:]) for t in _inputs(n * w, h, kdim, vdim, gen, raw=False)]
    for t in x:
        t[1, 2:] = 0
    rows = torch.tensor([2, 0, 3])
    got, want = (torch.full((5, w, h, kdim, vdim), float("nan")) for _ in range(2))
    before = pool.clone()
    monkeypatch.setenv(fused.ENV_VAR, "0")
    o_ref = kda_verify_padded(*x, pool, slots, snapshots=want, snapshot_rows=rows)
    monkeypatch.setenv(fused.ENV_VAR, "1")
    assert fused.verify_fusable(pool, slots, got)
    o = kda_verify_padded(*x, pool, slots, snapshots=got, snapshot_rows=rows)
    assert torch.equal(o, o_ref) and torch.equal(got[rows], want[rows]) and bool(got[1].isnan().all())
    assert torch.equal(pool, before)
    assert torch.equal(kda_verify_padded(*x, pool, slots), o_ref)  # without snapshots
