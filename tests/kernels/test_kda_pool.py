"""KDA over pool slots, on both backends (Triton under its interpreter on CPU): prefill with gathered and
scattered states and checkpoints, decode in place, replay bit-exact with decode."""

from __future__ import annotations

import pytest
import torch
from kda_inputs import KDAInputs, fla_reference, kda_inputs

from kernels.backend import ENV_VAR
from kernels.kda import KDAGate, kda_recurrent
from kernels.kda_pool import kda_decode, kda_prefill, kda_replay, preprocess_step
from kernels.state_checkpoints import StateCheckpoints

H, K, V = 2, 16, 12
NUM_SLOTS = 9


def tol(backend: str) -> float:
    return 1e-5 if backend == "torch" else 1e-4


def close(a: torch.Tensor, b: torch.Tensor, atol: float) -> None:
    err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    assert a.shape == b.shape and err <= atol, err


def pool_for(x: KDAInputs, slots: list[int], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(NUM_SLOTS, H, K, V, generator=gen)
    pool[slots] = x.initial_state
    return pool


def prefill(x: KDAInputs, pool: torch.Tensor, slots: list[int], **kw) -> torch.Tensor:  # noqa: ANN003
    return kda_prefill(x.q, x.k, x.v, x.g, x.beta, pool, state_slots=torch.tensor(slots), cu_seqlens=x.cu_seqlens, **kw)


def test_prefill_reads_and_writes_slots(backend: str) -> None:
    lens = [1, 20, 37] if backend == "triton" else [1, 63, 64, 65, 130]
    slots = [7, 2, 5, 0, 3][: len(lens)]
    x = kda_inputs(lens, H, K, V, seed=10, decay="fast")
    fresh = torch.tensor([i == 1 for i in range(len(lens))])
    pool = pool_for(x, slots)
    pool[slots[1]] = float("nan")  # a fresh sequence must not read its slot
    before = pool.clone()
    o = prefill(x, pool, slots, has_initial_state=~fresh)
    ref_in = x._replace(initial_state=torch.where(fresh.view(-1, 1, 1, 1), 0.0, x.initial_state))
    o_ref, s_ref = fla_reference(ref_in)
    close(o, o_ref, tol(backend))
    close(pool[slots], s_ref, tol(backend))
    others = [s for s in range(NUM_SLOTS) if s not in slots]
    assert torch.equal(pool[others], before[others])


def test_triton_prefill_equals_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    x = kda_inputs([3, 33], H, K, V, seed=11)
    slots = [4, 1]
    ck = StateCheckpoints(torch.tensor([1, 1, 0]), torch.tensor([5, 16, 3]), torch.tensor([0, 6, 8]))
    results = []
    for be in ("torch", "triton"):
        monkeypatch.setenv(ENV_VAR, be)
        pool = pool_for(x, slots)
        results.append((prefill(x, pool, slots, checkpoints=ck), pool))
    close(results[1][0], results[0][0], 1e-4)
    close(results[1][1], results[0][1], 1e-4)


def test_checkpoints_equal_prefix_prefills(backend: str) -> None:
    """The state emitted at offset p equals the final state of a prefill of the first p tokens, at, before and
    after chunk boundaries (64 for torch, 16 for Triton), for two sequences at once."""
    if backend == "torch":
        lens, offsets = [150, 70], [[0, 1, 63, 64, 65, 128, 150], [64, 69]]
    else:
        lens, offsets = [40, 18], [[0, 1, 15, 16, 17, 33, 40], [16, 17]]
    x = kda_inputs(lens, H, K, V, seed=12)
    slots = [0, 1]
    pairs = [(i, p) for i in range(len(lens)) for p in offsets[i]]
    ck_slots = list(range(2, 2 + len(pairs)))
    ck = StateCheckpoints(
        torch.tensor([i for i, _ in pairs]), torch.tensor([p for _, p in pairs]), torch.tensor(ck_slots)
    )
    pool = torch.zeros(2 + len(pairs), H, K, V)
    pool[slots] = x.initial_state
    prefill(x, pool, slots, checkpoints=ck)
    b = x.cu_seqlens.tolist()
    for (i, p), slot in zip(pairs, ck_slots, strict=True):
        sl = slice(b[i], b[i] + p)
        part = torch.zeros(1, H, K, V)
        part[0] = x.initial_state[i]
        kda_prefill(x.q[sl], x.k[sl], x.v[sl], x.g[sl], x.beta[sl], part, state_slots=torch.tensor([0]))
        close(pool[slot], part[0], 1e-5)


def test_commit_false_writes_only_checkpoints(backend: str) -> None:
    x = kda_inputs([20], H, K, V, seed=13)
    pool = pool_for(x, [3])
    before = pool.clone()
    ck = StateCheckpoints(torch.tensor([0]), torch.tensor([20]), torch.tensor([6]))
    o = prefill(x, pool, [3], checkpoints=ck, commit=False)
    o_ref, s_ref = kda_recurrent(x.q, x.k, x.v, x.g, x.beta, initial_state=x.initial_state)
    close(o, o_ref, tol(backend))
    close(pool[6], s_ref[0], tol(backend))
    keep = [s for s in range(NUM_SLOTS) if s != 6]
    assert torch.equal(pool[keep], before[keep])


def raw_steps(n: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(n, length, H, K, generator=gen),
        "k": torch.randn(n, length, H, K, generator=gen),
        "v": torch.randn(n, length, H, V, generator=gen),
        "g": torch.randn(n, length, H, K, generator=gen),
        "beta": torch.randn(n, length, H, generator=gen),
    }


GATES = [
    pytest.param(None, id="plain"),
    pytest.param(KDAGate(torch.randn(1, 1, H, 1), torch.randn(H * K)), id="softplus"),
    pytest.param(KDAGate(torch.randn(H), None, -5.0), id="lower-bound"),
]


@pytest.mark.parametrize("gate", GATES)
def test_decode_equals_recurrent(backend: str, gate: KDAGate | None) -> None:
    n, length = 3, 5
    r = raw_steps(n, length, 14)
    flags = {"gate": gate, "beta_logits": gate is not None, "qk_l2norm": gate is not None}
    if gate is None:  # plain decode takes the finished inputs
        r["g"] = -torch.rand(n, length, H, K)
        r["beta"] = torch.rand(n, length, H)
        r["k"] = torch.nn.functional.normalize(r["k"], dim=-1)
    slots = torch.tensor([5, 0, 2])
    pool = torch.randn(NUM_SLOTS, H, K, V)
    init = pool[slots].clone()
    outs = [kda_decode(*(r[a][:, t] for a in "qkvg"), r["beta"][:, t], pool, slots, **flags) for t in range(length)]
    for i in range(n):
        step = preprocess_step(r["k"][i], r["v"][i], r["g"][i], r["beta"][i], gate, flags["beta_logits"], False)
        qi = r["q"][i]
        if flags["qk_l2norm"]:
            qi, kn = (torch.nn.functional.normalize(z, dim=-1, eps=0) for z in (qi, step.k))
            step = step._replace(k=kn)
        o_ref, s_ref = kda_recurrent(qi, step.k, step.v, step.g, step.beta, initial_state=init[i : i + 1])
        close(torch.stack([o[i] for o in outs]), o_ref, tol(backend))
        close(pool[slots[i]], s_ref[0], tol(backend))


@pytest.mark.parametrize("gate", GATES)
def test_replay_is_decode_bit_for_bit(backend: str, gate: KDAGate | None) -> None:
    """Replay of the first n_i saved tokens == decode of those tokens, whatever the decode batches were."""
    n, length = 4, 5
    r = raw_steps(n, length, 15)
    flags = {"gate": gate, "beta_logits": True, "qk_l2norm": True}
    slots = torch.tensor([1, 6, 3, 8])
    counts = [0, 2, 5, 3]
    pool = torch.randn(NUM_SLOTS, H, K, V)
    decoded = pool.clone()
    for t in range(length):  # decode only the sequences still accepting tokens: the batch shrinks
        live = [i for i in range(n) if counts[i] > t]
        if live:
            args = (r[a][live, t] for a in "qkvg")
            kda_decode(*args, r["beta"][live, t], decoded, slots[live], **flags)
    replayed = pool.clone()
    kda_replay(r["k"], r["v"], r["g"], r["beta"], replayed, slots, torch.tensor(counts), **flags)
    assert torch.equal(replayed, decoded)
    assert torch.equal(replayed[slots[0]], pool[slots[0]])  # 0 tokens: untouched


def test_replay_of_nothing_is_a_no_op(backend: str) -> None:
    r = raw_steps(2, 3, 16)
    pool = torch.randn(NUM_SLOTS, H, K, V)
    before = pool.clone()
    kda_replay(r["k"], r["v"], r["g"], r["beta"], pool, torch.tensor([0, 4]), torch.tensor([0, 0]))
    assert torch.equal(pool, before)


def test_triton_decode_equals_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    r = raw_steps(3, 1, 17)
    gate = KDAGate(torch.randn(H), torch.randn(H * K))
    slots = torch.tensor([2, 7, 4])
    base = torch.randn(NUM_SLOTS, H, K, V)
    res = []
    for be in ("torch", "triton"):
        monkeypatch.setenv(ENV_VAR, be)
        pool = base.clone()
        o = kda_decode(*(r[a][:, 0] for a in "qkvg"), r["beta"][:, 0], pool, slots, gate=gate, beta_logits=True)
        res.append((o, pool))
    close(res[1][0], res[0][0], 1e-4)
    close(res[1][1], res[0][1], 1e-4)


def test_bad_slots_are_refused() -> None:
    x = kda_inputs([4, 4], H, K, V, seed=18)
    pool = torch.zeros(4, H, K, V)
    with pytest.raises(ValueError, match="distinct"):
        prefill(x, pool, [1, 1])
    with pytest.raises(ValueError, match="outside"):
        prefill(x, pool, [1, 4])
    ck = StateCheckpoints(torch.tensor([0]), torch.tensor([2]), torch.tensor([1]))
    with pytest.raises(ValueError, match="distinct"):
        prefill(x, pool, [1, 2], checkpoints=ck)
    with pytest.raises(ValueError, match="num_tokens"):
        r = raw_steps(1, 2, 0)
        kda_replay(r["k"], r["v"], r["g"], r["beta"], pool, torch.tensor([0]), torch.tensor([3]))


@pytest.mark.parametrize("lens", [[3, 1, 4], [2, 2]], ids=["ragged", "full"])
def test_verify_is_decode_bit_for_bit_and_leaves_the_state(lens: list[int]) -> None:
    """kda_verify over packed windows (ragged: padded inside; full: views) == decode of each window's tokens
    one by one, outputs bit for bit; the live states stay as they were; snapshots hold the state after each
    window position."""
    from kernels.kda_pool import kda_verify

    n, width, t_total = len(lens), max(lens), sum(lens)
    gen = torch.Generator().manual_seed(21)
    q, k = (torch.nn.functional.normalize(torch.randn(t_total, H, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(t_total, H, V, generator=gen)
    g = -torch.rand(t_total, H, K, generator=gen)
    beta = torch.rand(t_total, H, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    slots = torch.tensor([4, 7, 1][:n])
    pool = torch.randn(NUM_SLOTS, H, K, V, generator=gen)
    live = pool.clone()
    snaps = torch.zeros(5, width + 1, H, K, V)
    snap_rows = torch.tensor([3, 0, 2][:n])
    o = kda_verify(q, k, v, g, beta, pool, slots, cu, snapshots=snaps, snapshot_rows=snap_rows)
    assert torch.equal(pool, live)
    decoded = pool.clone()
    for i in range(n):
        for t in range(lens[i]):
            j = int(cu[i]) + t
            one = slice(j, j + 1)
            o_ref = kda_decode(q[one], k[one], v[one], g[one], beta[one], decoded, slots[i : i + 1])
            assert torch.equal(o[one], o_ref)
            assert torch.equal(snaps[snap_rows[i], t], decoded[slots[i]])
