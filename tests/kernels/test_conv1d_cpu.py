"""The short conv's CPU ops (`kernels.conv1d_cpu`) against the torch paths they replace (their oracles,
`RADIXK3_FUSED_CONV=0`). Decode: the same bits, in the outputs and in every state of the pool, over kernel
widths 2 to 4, batch sizes 1 to 33, with and without the activation, a pool whose slots lie further apart than a
slot (the pool buffer's per-layer views), rows sharing one scratch slot (the decode graph's padding). The verify
windows of speculation and a varlen prefill with initial states and checkpoints: the same bits too."""

from __future__ import annotations

import platform

import pytest
import torch
from torch import Tensor

from kernels import conv1d_cpu as fused
from kernels.conv1d_pool import conv1d_decode, conv1d_prefill, conv1d_verify_padded
from kernels.state_checkpoints import StateCheckpoints

SLOTS = 40
X86 = platform.machine().lower() in ("x86_64", "amd64")
pytestmark = pytest.mark.skipif(not X86, reason="the fused op is built on x86 only")


def test_builds_here() -> None:
    """On x86 with a compiler (CI included) the op must build: a silent fallback would leave it untested."""
    assert fused.available()


def _pool(c: int, keep: int, gen: torch.Generator) -> Tensor:
    """A [SLOTS, c, keep] fp32 view whose slots lie 5 floats more than a slot apart; the gaps hold NaN."""
    slot = c * keep
    flat = torch.full((SLOTS * (slot + 5),), float("nan"))
    pool = flat.as_strided((SLOTS, c, keep), (slot + 5, keep, 1))
    pool.copy_(torch.randn(SLOTS, c, keep, generator=gen))
    return pool


def _both(monkeypatch: pytest.MonkeyPatch, x: Tensor, weight: Tensor, pool: Tensor, slots: Tensor,
          activation: str | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(fused y, fused pool, torch y, torch pool) from the same pool and inputs."""
    ref = pool.clone()
    monkeypatch.setenv(fused.ENV_VAR, "0")
    y_ref = conv1d_decode(x, weight, ref, slots, activation=activation, validate=False)
    monkeypatch.setenv(fused.ENV_VAR, "1")
    assert fused.available() and fused.fusable(x, pool)
    y = conv1d_decode(x, weight, pool, slots, activation=activation, validate=False)
    return y, pool, y_ref, ref


@pytest.mark.parametrize(("c", "width"), [(1536, 4), (96, 3), (33, 2), (4096, 4)])
@pytest.mark.parametrize("activation", ["silu", None])
def test_fused_decode_is_the_torch_step(monkeypatch: pytest.MonkeyPatch, c: int, width: int,
                                        activation: str | None) -> None:
    gen = torch.Generator().manual_seed(c + width)
    weight = torch.randn(c, width, generator=gen)
    for n in (1, 5, 33):
        pool = _pool(c, width - 1, gen)
        slots = torch.randperm(SLOTS, generator=gen)[:n]
        for _ in range(width + 1):  # more steps than the window: every saved input is one the op shifted in
            x = torch.randn(n, c, generator=gen)
            y, got, y_ref, want = _both(monkeypatch, x, weight, pool, slots, activation)
            assert torch.equal(y, y_ref), (n, (y - y_ref).abs().max())
            assert torch.equal(got, want)  # every slot: the untouched ones too
            pool = got


def test_rows_sharing_a_scratch_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Padding rows all name one scratch slot: the real rows are exact, the scratch slot takes the first padding
    row's shift only, and the other slots are untouched."""
    c, width, scratch = 1536, 4, SLOTS - 1
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(c, width, generator=gen)
    pool = _pool(c, width - 1, gen)
    slots = torch.tensor([5, 0, 17, scratch, scratch, scratch])
    x = torch.randn(len(slots), c, generator=gen)
    before = pool.clone()
    y, got, y_ref, want = _both(monkeypatch, x, weight, pool, slots, "silu")
    assert torch.equal(y[:3], y_ref[:3]) and bool(y.isfinite().all())
    assert torch.equal(got[:scratch], want[:scratch])
    monkeypatch.setenv(fused.ENV_VAR, "0")
    first = before.clone()
    y_first = conv1d_decode(x[:4], weight, first, slots[:4], validate=False)  # the real rows, the first padding row
    assert torch.equal(y[3], y_first[3]) and torch.equal(got[scratch], first[scratch])


def test_bf16_keeps_the_torch_path() -> None:
    pool = torch.zeros(4, 8, 3, dtype=torch.bfloat16)
    assert not fused.fusable(torch.zeros(1, 8, dtype=torch.bfloat16), pool)
    assert not fused.fusable(torch.zeros(1, 8), pool)


@pytest.mark.parametrize(("c", "width", "length"), [(1536, 4, 4), (96, 3, 1), (33, 2, 6), (40, 4, 2)])
def test_fused_verify_is_the_torch_window(monkeypatch: pytest.MonkeyPatch, c: int, width: int, length: int) -> None:
    """Windows of `length` positions (one padded with zeros after its first position): the same bits as the torch
    path, positions before and past the saved inputs, and the pool untouched."""
    gen = torch.Generator().manual_seed(c * width + length)
    weight = torch.randn(c, width, generator=gen)
    pool = _pool(c, width - 1, gen)
    slots = torch.tensor([7, 0, 21])
    x = torch.randn(len(slots), length, c, generator=gen)
    x[1, 1:] = 0
    before = pool.clone()
    monkeypatch.setenv(fused.ENV_VAR, "0")
    want = conv1d_verify_padded(x, weight, pool, slots)
    monkeypatch.setenv(fused.ENV_VAR, "1")
    got = conv1d_verify_padded(x, weight, pool, slots)
    assert torch.equal(got, want) and torch.equal(pool, before)


@pytest.mark.parametrize(("c", "width"), [(1536, 4), (33, 3), (8, 2)])
def test_fused_prefill_is_the_torch_path(monkeypatch: pytest.MonkeyPatch, c: int, width: int) -> None:
    """Sequences of 1, 2, 70 and 5 tokens (shorter and longer than the window), one without an initial state,
    checkpoints inside two of them: the same outputs, final states and checkpoint states, bit for bit."""
    gen = torch.Generator().manual_seed(c + width)
    weight = torch.randn(c, width, generator=gen)
    lens = [1, 2, 70, 5]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    x = torch.randn(int(cu[-1]), c, generator=gen)
    slots = torch.tensor([3, 11, 0, 25])
    has = torch.tensor([True, False, True, True])
    ck = StateCheckpoints(torch.tensor([2, 2, 3]), torch.tensor([1, 64, 4]), torch.tensor([30, 31, 32]))
    pool = _pool(c, width - 1, gen)
    outs = []
    for fused_on in ("0", "1"):
        monkeypatch.setenv(fused.ENV_VAR, fused_on)
        p = pool.clone()
        y = conv1d_prefill(x, weight, p, state_slots=slots, cu_seqlens=cu, has_initial_state=has, checkpoints=ck)
        outs.append((y, p))
    (y_ref, want), (y, got) = outs
    assert torch.equal(y, y_ref) and torch.equal(got, want)
