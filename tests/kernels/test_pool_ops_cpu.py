"""The captured steps' pool ops registered in C++ (`kernels.pool_ops_cpu`) against the Python bodies they replace
(the decode graph's fused paths: `conv1d_cpu_prepared` + SiLU, `kda_decode_cpu`, the latent store +
`mla_decode_padded_cpu`; the verify graph's window ops in replay mode): the same bits in the outputs and in every
pool and ring byte, on pools whose slots lie further apart than a slot (the pool buffer's per-layer views), inputs
that are views with gaps (as a graph passes its projections' slices), rows sharing one scratch slot (the padding),
batch 1 and 9; ReplaySSM's commit against the torch replay; an unknown cache key, layer or ring is an error naming
it."""

from __future__ import annotations

import itertools
import platform

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import pool_ops_cpu
from kernels.conv1d_cpu import conv1d_cpu_prepared, conv1d_verify_cpu
from kernels.conv1d_pool import conv1d_replay
from kernels.kda_decode_cpu import kda_decode_cpu, kda_verify_cpu
from kernels.kda_pool import kda_replay
from kernels.mla import mla_decode_padded_cpu

X86 = platform.machine().lower() in ("x86_64", "amd64")
pytestmark = pytest.mark.skipif(not X86, reason="the C++ CPU ops are built on x86 only")
SLOTS, ROWS = 12, 64
H, K, V = 2, 16, 32  # KDA heads
C, W = 3 * H * K, 4  # short conv channels, taps
MH, DN, DR, R, DV = 2, 8, 4, 16, 8  # MLA heads, nope / rope dims, latent rank, value dim
_KEYS = itertools.count(1_000_000)  # away from the decode graphs' keys


def test_builds_here() -> None:
    """On x86 with a compiler (CI included) the ops must build: a silent fallback would leave them untested."""
    assert pool_ops_cpu.available()


def _gappy(shape: tuple[int, ...], gap: int, gen: torch.Generator) -> Tensor:
    """A random fp32 view of `shape` whose leading-dim entries lie `gap` floats further apart."""
    inner = torch.empty(shape[1:])
    flat = torch.full((shape[0] * (inner.numel() + gap),), float("nan"))
    view = flat.as_strided(shape, (inner.numel() + gap, *inner.stride()))
    view.copy_(torch.randn(shape, generator=gen))
    return view


def _pools(gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    return _gappy((SLOTS, C, W - 1), 5, gen), _gappy((SLOTS, H, K, V), 7, gen), _gappy((ROWS, R + DR), 3, gen)


def _clone(t: Tensor) -> Tensor:
    return torch.empty_strided(t.shape, t.stride()).copy_(t)


def _registered(gen: torch.Generator) -> tuple[int, tuple[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]:
    """A fresh key with its pools registered (one layer each), and a copy of the pools for the reference."""
    pools = _pools(gen)
    key = next(_KEYS)
    pool_ops_cpu.register_pools(key, [pools[0]], [pools[1]], [pools[2]])
    return key, pools, tuple(_clone(p) for p in pools)  # type: ignore[return-value]


def _slots(n: int) -> Tensor:
    """n rows' slots, distinct, then two padding rows on one scratch slot."""
    return torch.cat([torch.randperm(SLOTS - 1)[:n], torch.full((2,), SLOTS - 1)])


def _cols(t: Tensor, width: int) -> Tensor:
    """t [N, ..., d] as a view with `width` extra columns per row: a slice of a wider projection."""
    wide = torch.randn(*t.shape[:-1], t.shape[-1] + width)
    wide[..., : t.shape[-1]] = t
    return wide[..., : t.shape[-1]]


@pytest.fixture(autouse=True)
def _available(request: pytest.FixtureRequest) -> None:
    if request.node.name != "test_builds_here" and not pool_ops_cpu.available():
        pytest.skip("the C++ ops are not built here")  # test_builds_here fails instead on x86


@pytest.mark.parametrize("n", [1, 9])
def test_conv_decode_is_the_python_path(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    key, (pool, _, _), (ref, _, _) = _registered(gen)
    slots = _slots(n)
    x = _cols(torch.randn(n + 2, C, generator=gen), 6)
    weight = torch.randn(C, W, generator=gen)
    got = pool_ops_cpu.conv_decode(key, 0, x, weight, slots)
    want = F.silu(conv1d_cpu_prepared(x.contiguous(), weight, ref, slots))
    assert torch.equal(got, want) and got.is_contiguous()
    assert torch.equal(pool, ref)
    pool_ops_cpu.unregister_pools(key)


@pytest.mark.parametrize("n", [1, 9])
def test_kda_decode_is_the_python_path(n: int) -> None:
    gen = torch.Generator().manual_seed(10 + n)
    key, (_, pool, _), (_, ref, _) = _registered(gen)
    slots = _slots(n)
    rows = n + 2
    q, k = (_cols(torch.randn(rows, H, K, generator=gen), 3) for _ in range(2))
    g = _cols(-torch.rand(rows, H, K, generator=gen), 5)
    v = _cols(torch.randn(rows, H, V, generator=gen), 2)
    beta = torch.rand(rows, H + 1, generator=gen)[:, :H]
    got = pool_ops_cpu.kda_decode(key, 0, q, k, v, g, beta, slots)
    want = kda_decode_cpu(q, k, v, g, beta, ref, slots, K**-0.5)
    assert torch.equal(got, want) and got.is_contiguous()
    assert torch.equal(pool, ref)
    pool_ops_cpu.unregister_pools(key)


# (heads, nope dim, rope dim, latent rank, value dim): the file's small shapes, and Kimi-Linear's (its absorbed
# products are the op's own bmm calls where the Python path's are einsum's: the same bits at real sizes too)
MLA_SHAPES = [(MH, DN, DR, R, DV), (32, 128, 64, 512, 128)]


@pytest.mark.parametrize(("n", "shape"), [(1, MLA_SHAPES[0]), (9, MLA_SHAPES[0]), (4, MLA_SHAPES[1])])
def test_mla_decode_is_the_python_path(n: int, shape: tuple[int, int, int, int, int]) -> None:
    mh, dn, dr, r, dv = shape
    gen = torch.Generator().manual_seed(20 + n)
    key = next(_KEYS)
    buf = _gappy((ROWS, r + dr), 3, gen)
    ref = _clone(buf)
    pool_ops_cpu.register_pools(key, [], [], [buf])
    kv_slots = torch.randperm(ROWS - 1)[:n]
    lens = torch.randint(1, 20, (n,), generator=gen)
    kv_rows = torch.randint(0, ROWS, (n, 24), generator=gen)
    kv_rows[torch.arange(n), lens - 1] = kv_slots  # each row's own new latent is its last
    q_nope = _cols(torch.randn(n, mh, dn, generator=gen), 4)
    q_pe = _cols(torch.randn(n, mh, dr, generator=gen), 4)
    latent = torch.randn(n, r + dr, generator=gen)
    kv_b = torch.randn(mh * (dn + dv), r, generator=gen)
    got = pool_ops_cpu.mla_decode(key, 0, q_nope, q_pe, latent, kv_b, kv_slots, kv_rows, lens, 0.3)
    ref.index_put_((kv_slots,), latent)
    want = mla_decode_padded_cpu(q_nope, q_pe, ref, kv_b, kv_rows, lens, scale=0.3).contiguous()
    assert torch.equal(got, want) and got.is_contiguous()
    assert torch.equal(buf, ref)
    pool_ops_cpu.unregister_pools(key)


def _rings(rows: int, width: int, gen: torch.Generator) -> list[Tensor]:
    """A draft window's input rings, one layer: x [R, W, C], k [R, W, H, K], v [R, W, H, V], g, beta (fp32)."""
    return [torch.randn(rows, width, *shape, generator=gen) for shape in ((C,), (H, K), (H, V), (H, K), (H,))]


@pytest.mark.parametrize(("n", "width"), [(1, 4), (3, 2)])
def test_verify_ops_are_the_python_path(n: int, width: int) -> None:
    """The window ops: the same outputs as `conv1d_verify_cpu` + SiLU and `kda_verify_cpu`, the live states
    untouched, and the window's inputs in the rings' rows (`SpecWindow.save_*_inputs`), the other rows as they
    were; the rings are one position wider than the window."""
    gen = torch.Generator().manual_seed(40 + n)
    key, (conv_pool, pool, _), _ = _registered(gen)
    rings = _rings(6, width + 1, gen)
    want_rings = [r.clone() for r in rings]
    pool_ops_cpu.register_window(key, *([r] for r in rings))
    slots, rows = torch.randperm(SLOTS)[:n], torch.randperm(6)[:n]
    before = conv_pool.clone(), pool.clone()
    x = _cols(torch.randn(n, width, C, generator=gen), 4)
    weight = torch.randn(C, W, generator=gen)
    got = pool_ops_cpu.conv_verify(key, 0, x, weight, slots, rows)
    assert torch.equal(got, F.silu(conv1d_verify_cpu(x, weight, conv_pool, slots))) and got.is_contiguous()
    q, k = (_cols(torch.randn(n, width, H, K, generator=gen), 3) for _ in range(2))
    g = -torch.rand(n, width, H, K, generator=gen)
    v = torch.randn(n, width, H, V, generator=gen)
    beta = _cols(torch.rand(n, width, H, generator=gen), 1)
    got = pool_ops_cpu.kda_verify(key, 0, q, k, v, g, beta, slots, rows)
    assert torch.equal(got, kda_verify_cpu(q, k, v, g, beta, pool, slots, K**-0.5, None, None))
    assert torch.equal(conv_pool, before[0]) and torch.equal(pool, before[1])
    for ring, want, saved in zip(rings, want_rings, (x, k, v, g, beta), strict=True):
        want[:, :width].index_copy_(0, rows, saved)
        assert torch.equal(ring, want)
    pool_ops_cpu.unregister_pools(key)


@pytest.mark.parametrize("counts", [[4], [1, 4, 2]])
def test_window_commit_is_the_torch_replay(counts: list[int]) -> None:
    """ReplaySSM's commit in one call: every layer's live recurrent and conv states (two layers, gappy pools)
    end bit for bit where `kda_replay` and `conv1d_replay` (torch) leave them from the same saved inputs, each
    sequence over its own count of the window's 4 positions; other slots and the rings untouched."""
    gen = torch.Generator().manual_seed(50 + len(counts))
    n, width = len(counts), 4
    conv = [_gappy((SLOTS, C, W - 1), 5, gen) for _ in range(2)]
    recurrent = [_gappy((SLOTS, H, K, V), 7, gen) for _ in range(2)]
    key = next(_KEYS)
    pool_ops_cpu.register_pools(key, conv, recurrent, [])
    rings = [_rings(6, width, gen) for _ in range(2)]
    for ring in rings:
        ring[3].copy_(-torch.rand(ring[3].shape, generator=gen))  # log decays
        ring[4].copy_(torch.rand(ring[4].shape, generator=gen))  # betas
    pool_ops_cpu.register_window(key, *([ring[i] for ring in rings] for i in range(5)))
    saved = [[r.clone() for r in ring] for ring in rings]
    want_conv, want_rec = [_clone(p) for p in conv], [_clone(p) for p in recurrent]
    slots, rows, num_tokens = torch.randperm(SLOTS)[:n], torch.randperm(6)[:n], torch.tensor(counts)
    before = _clone(recurrent[0])
    pool_ops_cpu.window_commit(key, slots, rows, num_tokens)
    for layer, (x, k, v, g, beta) in enumerate(rings):
        sel = [t[:, : max(counts)].index_select(0, rows) for t in (x, k, v, g, beta)]
        kda_replay(*sel[1:], want_rec[layer], slots, num_tokens, validate=False)
        conv1d_replay(sel[0], want_conv[layer], slots, num_tokens, validate=False)
        assert torch.equal(recurrent[layer], want_rec[layer]), f"layer {layer}"
        assert torch.equal(conv[layer], want_conv[layer]), f"layer {layer}"
        assert all(torch.equal(a, b) for a, b in zip(rings[layer], saved[layer], strict=True))
    assert not torch.equal(recurrent[0][slots], before[slots])  # the commit moved the states
    with pytest.raises(RuntimeError, match="sequence 0 has 5 tokens"):  # past the window: refused, not read
        pool_ops_cpu.window_commit(key, slots[:1], rows[:1], torch.tensor([5]))
    pool_ops_cpu.unregister_pools(key)


def test_unknown_key_or_layer_is_an_error() -> None:
    gen = torch.Generator().manual_seed(30)
    key, _, _ = _registered(gen)
    x, weight, slots = torch.randn(1, C), torch.randn(C, W), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="conv pool 1 not registered"):
        pool_ops_cpu.conv_decode(key, 1, x, weight, slots)
    with pytest.raises(RuntimeError, match="conv input ring 0 not registered"):  # no draft window registered
        pool_ops_cpu.conv_verify(key, 0, x[:, None], weight, slots, slots)
    pool_ops_cpu.unregister_pools(key)
    with pytest.raises(RuntimeError, match=f"no pools registered under cache key {key}"):
        pool_ops_cpu.conv_decode(key, 0, x, weight, slots)
