"""The fused MLA decode middle on CPU (`kernels.mla_decode_cpu`) against the torch path it replaces
(`mla_decode_padded` with `RADIXK3_FUSED_MLA=0`, its oracle): within fp32 rounding (2e-6 relative to the
output's scale: the sums run in another order), over one to 33 query rows, row tables padded past each row's
length with any valid row (as the decode graph pads them), a pool whose rows lie further apart than a row (the
pool buffer's per-layer views, the gaps NaN: never read), and head shapes of kimi-linear and the tiny presets; a
row alone and in a batch gets the same bits. A bf16 step keeps the torch path."""

from __future__ import annotations

import platform

import pytest
import torch
from torch import Tensor

from kernels import mla_decode_cpu as fused
from kernels.mla import mla_decode_padded

X86 = platform.machine().lower() in ("x86_64", "amd64")
pytestmark = pytest.mark.skipif(not X86, reason="the op is built on x86 only")
ROWS = 300


def test_builds_here() -> None:
    """On x86 with a compiler (CI included) the op must build: a silent fallback would leave it untested."""
    assert fused.available()


def _pool(e: int, gen: torch.Generator) -> Tensor:
    """A [ROWS, e] fp32 view whose rows lie 5 floats more than a row apart; the gaps hold NaN."""
    flat = torch.full((ROWS * (e + 5),), float("nan"))
    pool = flat.as_strided((ROWS, e), (e + 5, 1))
    pool.copy_(torch.randn(ROWS, e, generator=gen))
    return pool


@pytest.mark.parametrize(("h", "dn", "dr", "r", "dv"), [(2, 32, 16, 64, 32), (4, 128, 64, 512, 128)])
@pytest.mark.parametrize("n", [1, 4, 33])
def test_fused_equals_the_torch_path(monkeypatch: pytest.MonkeyPatch, h: int, dn: int, dr: int, r: int, dv: int,
                                     n: int) -> None:
    gen = torch.Generator().manual_seed(n * 7 + h)
    pool = _pool(r + dr, gen)
    q_nope, q_pe = torch.randn(n, h, dn, generator=gen), torch.randn(n, h, dr, generator=gen)
    w = torch.randn(h * (dn + dv), r, generator=gen) / r**0.5
    lens = torch.randint(1, 120, (n,), generator=gen)
    lens[0] = 1  # a row that sees only itself
    width = int(lens.max()) + 9  # padding past every row's length, as the graph pads to a multiple of 16
    rows = torch.randint(0, ROWS, (n, width), generator=gen)
    got = mla_decode_padded(q_nope, q_pe, pool, w, rows, lens, scale=0.1)
    monkeypatch.setenv(fused.ENV_VAR, "0")
    want = mla_decode_padded(q_nope, q_pe, pool, w, rows, lens, scale=0.1)
    assert got.shape == want.shape == (n, h, dv)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * float(want.abs().max()))


@pytest.mark.parametrize(("h", "r", "dr"), [(8, 128, 32), (2, 64, 16), (4, 512, 64)])
def test_a_row_gets_the_same_bits_alone_or_in_a_batch(h: int, r: int, dr: int) -> None:
    """The op splits a batch by rows and a single row by heads; every head's sums run in the same order either
    way, so a request's attention does not depend on what it is batched with."""
    gen = torch.Generator().manual_seed(h + r)
    n = 5
    pool = _pool(r + dr, gen)
    q = torch.randn(n, h, r + dr, generator=gen)
    lens = torch.tensor([1, 17, 150, 33, 160])
    rows = torch.randint(0, ROWS, (n, int(lens.max())), generator=gen)
    together = fused.mla_decode_latent_cpu(q, pool, rows, lens, r, 0.1)
    alone = torch.cat([fused.mla_decode_latent_cpu(q[i : i + 1], pool, rows[i : i + 1], lens[i : i + 1], r, 0.1)
                       for i in range(n)])
    assert torch.equal(together, alone)


def test_bf16_keeps_the_torch_path() -> None:
    pool = torch.randn(ROWS, 80).bfloat16()
    q = torch.randn(1, 2, 80).bfloat16()
    assert not fused.fusable(q, pool) and fused.fusable(q.float(), pool.float())
