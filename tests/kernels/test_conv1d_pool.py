"""Causal conv1d over pool slots on both backends: prefill with checkpoints, decode in place, replay."""

from __future__ import annotations

import pytest
import torch

from kernels.backend import ENV_VAR
from kernels.conv1d import causal_conv1d
from kernels.conv1d_pool import conv1d_decode, conv1d_prefill, conv1d_replay
from kernels.state_checkpoints import StateCheckpoints

C, W, NUM_SLOTS = 10, 4, 12


def data(lens: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), C, generator=gen)
    w = torch.randn(C, W, generator=gen)
    pool = torch.randn(NUM_SLOTS, C, W - 1, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    return x, w, pool, cu


def test_prefill_with_slots_and_checkpoints(backend: str) -> None:
    lens = [1, 2, 9, 20]
    x, w, pool, cu = data(lens, 0)
    slots = torch.tensor([3, 7, 1, 0])
    has_init = torch.tensor([True, True, False, True])
    pool[1] = float("nan")  # the fresh sequence's slot is never read
    init = torch.where(has_init.view(-1, 1, 1), pool[slots], 0.0)
    ck = StateCheckpoints(torch.tensor([2, 3, 3, 0, 1]), torch.tensor([1, 0, 20, 1, 1]), torch.tensor([2, 4, 5, 6, 8]))
    before = pool.clone()
    y = conv1d_prefill(x, w, pool, state_slots=slots, cu_seqlens=cu, has_initial_state=has_init, checkpoints=ck)
    y_ref, final_ref = causal_conv1d(x, w, cu_seqlens=cu, initial_state=init)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(pool[slots], final_ref, rtol=0, atol=0)
    b = cu.tolist()
    for seq, off, slot in zip(*(t.tolist() for t in ck), strict=True):  # = the final state of the prefix
        _, part = causal_conv1d(x[b[seq] : b[seq] + off], w, initial_state=init[seq : seq + 1])
        torch.testing.assert_close(pool[slot], part[0], rtol=0, atol=0)
    untouched = [s for s in range(NUM_SLOTS) if s not in (*slots.tolist(), *ck.slot.tolist())]
    assert torch.equal(pool[untouched], before[untouched])


def test_commit_false_keeps_live_slots(backend: str) -> None:
    x, w, pool, cu = data([5, 6], 1)
    before = pool.clone()
    conv1d_prefill(x, w, pool, state_slots=torch.tensor([0, 1]), cu_seqlens=cu, commit=False)
    assert torch.equal(pool, before)


def test_decode_and_replay(backend: str) -> None:
    """Decode over tokens == prefill over them; replay of the first n saved inputs == decode of n tokens."""
    n, length = 3, 4
    x, w, pool, _ = data([n * length], 2)
    x = x.view(n, length, C)
    slots = torch.tensor([5, 9, 2])
    decoded = pool.clone()
    ys = [conv1d_decode(x[:, t], w, decoded, slots) for t in range(length)]
    for i in range(n):
        y_ref, final = causal_conv1d(x[i], w, initial_state=pool[slots[i : i + 1]])
        torch.testing.assert_close(torch.stack([y[i] for y in ys]), y_ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(decoded[slots[i]], final[0], rtol=0, atol=0)
    counts = [0, 1, 4]
    replayed = pool.clone()
    conv1d_replay(x, replayed, slots, torch.tensor(counts))
    for i, c in enumerate(counts):
        expect = pool[slots[i]].clone()
        for t in range(c):
            expect = torch.cat([expect[:, 1:], x[i, t][:, None]], dim=1)
        assert torch.equal(replayed[slots[i]], expect)


def test_triton_equals_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, pool, cu = data([3, 17], 3)
    slots = torch.tensor([4, 6])
    res = []
    for be in ("torch", "triton"):
        monkeypatch.setenv(ENV_VAR, be)
        p = pool.clone()
        y = conv1d_prefill(x, w, p, state_slots=slots, cu_seqlens=cu, activation=None)
        yd = conv1d_decode(x[:2], w, p, slots, activation=None)
        res.append((y, yd, p))
    for a, b in zip(*res, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


@pytest.mark.parametrize("lens", [[3, 1, 4], [2, 2]], ids=["ragged", "full"])
def test_verify_is_decode_bit_for_bit_and_leaves_the_state(lens: list[int]) -> None:
    """Outputs equal decode's up to the activation's last bit (SiLU's vector and tail paths differ with the
    tensor size); the states (copies) bit for bit; the live states untouched."""
    from kernels.conv1d_pool import conv1d_verify

    x, w, pool, cu = data(lens, 8)
    n = len(lens)
    slots = torch.tensor([3, 11, 6][:n])
    live = pool.clone()
    snaps = torch.zeros(4, max(lens) + 1, C, W - 1)
    snap_rows = torch.tensor([1, 3, 0][:n])
    y = conv1d_verify(x, w, pool, slots, cu, snapshots=snaps, snapshot_rows=snap_rows)
    assert torch.equal(pool, live)
    decoded = pool.clone()
    for i in range(n):
        for t in range(lens[i]):
            j = int(cu[i]) + t
            y_ref = conv1d_decode(x[j : j + 1], w, decoded, slots[i : i + 1])
            torch.testing.assert_close(y[j : j + 1], y_ref, rtol=0, atol=1e-6)
            assert torch.equal(snaps[snap_rows[i], t], decoded[slots[i]])
