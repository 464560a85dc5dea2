"""KDA torch reference ops: chunked == recurrent == fla-core's naive recurrence; decode == recurrent."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kda_inputs import KDAInputs, fla_reference, kda_inputs

import kernels.kda_chunk as kda_chunk
import kernels.kda_intra as kda_intra
from kernels.kda import kda_chunked, kda_decode_step, kda_gate, kda_recurrent, l2norm

TOL = 1e-5
LENS = [1, 63, 64, 65, 200]


def run(fn, x: KDAInputs, **kw):  # noqa: ANN001, ANN201 - a test helper over both ops
    return fn(x.q, x.k, x.v, x.g, x.beta, initial_state=x.initial_state, cu_seqlens=x.cu_seqlens, **kw)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    err = (a.float() - b.float()).abs().max().item()
    assert err <= TOL, err


@pytest.mark.parametrize("decay", ["model", "fast", "none"])
def test_chunked_and_recurrent_match_fla(decay: str) -> None:
    x = kda_inputs(LENS, decay=decay, seed=1)
    o_ref, s_ref = fla_reference(x)
    o_rec, s_rec = run(kda_recurrent, x)
    o_chk, s_chk = run(kda_chunked, x)
    for o, s in ((o_rec, s_rec), (o_chk, s_chk)):
        close(o, o_ref)
        close(s, s_ref)


@pytest.mark.parametrize("fp32_range,fp64_range", [(1e9, 1e9), (-1.0, 1e9), (-1.0, -1.0)])
def test_every_intra_tier_is_exact(monkeypatch: pytest.MonkeyPatch, fp32_range: float, fp64_range: float) -> None:
    """Force every chunk down one tier: factored in fp32 (fine here: these decays stay within fp32's range),
    factored in float64, or blocked with materialised diagonal blocks."""
    monkeypatch.setattr(kda_intra, "RANGE_FP32", fp32_range)
    monkeypatch.setattr(kda_intra, "RANGE_FP64", fp64_range)
    x = kda_inputs([70, 130], decay="model", seed=2)
    o_ref, s_ref = fla_reference(x)
    o_chk, s_chk = run(kda_chunked, x)
    close(o_chk, o_ref)
    close(s_chk, s_ref)


def test_fast_decay_does_not_cancel() -> None:
    """A channel whose cumulative decay reaches thousands inside a chunk, next to slow channels: exact only if
    decays are never formed as differences of large cumulative sums."""
    x = kda_inputs([64, 64], decay="fast", seed=3)
    g = x.g.clone()
    g[:, 0, 0] = -60.0  # 64 tokens x 60: cumulative -3840 on one channel
    g[:, 1, :] = -0.01
    x = x._replace(g=g)
    o_ref, s_ref = fla_reference(x)
    o, s = run(kda_chunked, x)
    close(o, o_ref)
    close(s, s_ref)


@pytest.mark.parametrize("chunk_size", [8, 16, 32, 128])
def test_chunk_sizes(chunk_size: int) -> None:
    x = kda_inputs([5, 100, 33], seed=4)
    o_rec, s_rec = run(kda_recurrent, x)
    o, s = run(kda_chunked, x, chunk_size=chunk_size)
    close(o, o_rec)
    close(s, s_rec)


def test_short_ranks_are_padded_less() -> None:
    """A rank of short chunks (tails, short prompts) is padded to the next 16 x 2^k tokens, never below 16."""
    plan = kda_chunk.plan_chunks([0, 66, 132, 133], 64, cuts=[(0, 5)], device=torch.device("cpu"))
    # rank 0: 5, 66 and 1 tokens; rank 1: the tail 5..64 of sequence 0 and 64..66 of sequence 1
    assert plan.rank_width == [64, 64, 16]
    assert [kda_chunk.padded_width(n, 64) for n in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    assert kda_chunk.padded_width(3, 8) == 8


@pytest.mark.parametrize("decay", ["model", "fast"])
def test_short_ranks_give_the_full_width_bits(monkeypatch: pytest.MonkeyPatch, decay: str) -> None:
    """Padding a short rank less changes no bit of outputs or states: every padding row only adds exact zeros,
    and from 16 rows up the triangular inverse's blocks are the same."""
    x = kda_inputs([66, 66, 2, 81, 17, 130, 1], h=2, kdim=64, vdim=64, seed=21, decay=decay)
    trimmed = run(kda_chunked, x)
    monkeypatch.setattr(kda_chunk, "padded_width", lambda longest, chunk_size: chunk_size)
    full = run(kda_chunked, x)
    assert torch.equal(trimmed[0], full[0]) and torch.equal(trimmed[1], full[1])


def test_bad_chunk_size() -> None:
    x = kda_inputs([5], seed=0)
    with pytest.raises(ValueError, match="chunk_size"):
        run(kda_chunked, x, chunk_size=48)


def test_single_sequence_defaults() -> None:
    """cu_seqlens None = one sequence; initial state None = zeros; scale defaults to K^-0.5."""
    x = kda_inputs([150], seed=5, zero_state=True)
    o_ref, s_ref = fla_reference(x)
    for fn in (kda_recurrent, kda_chunked):
        o, s = fn(x.q, x.k, x.v, x.g, x.beta)
        close(o, o_ref)
        close(s, s_ref)


def test_explicit_scale_and_empty_sequence() -> None:
    x = kda_inputs([40, 0, 70], seed=6)
    o_rec, s_rec = run(kda_recurrent, x, scale=0.3)
    o, s = run(kda_chunked, x, scale=0.3)
    close(o, o_rec)
    close(s, s_rec)
    close(s[1], x.initial_state[1])  # an empty sequence keeps its state


def test_bf16_inputs_give_bf16_outputs() -> None:
    x = kda_inputs([70], seed=7)
    xb = x._replace(q=x.q.bfloat16(), k=x.k.bfloat16(), v=x.v.bfloat16())
    o, s = run(kda_chunked, xb)
    o_rec, s_rec = run(kda_recurrent, xb)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    close(s, s_rec)


def test_decode_steps_equal_recurrent() -> None:
    x = kda_inputs([9, 9, 9], seed=8)
    _, s_rec = run(kda_recurrent, x)
    o_rec, _ = run(kda_recurrent, x)
    state = x.initial_state.clone()
    b = x.cu_seqlens.tolist()
    for t in range(9):
        rows = [b[i] + t for i in range(3)]
        o = kda_decode_step(x.q[rows], x.k[rows], x.v[rows], x.g[rows], x.beta[rows], state)
        close(o, o_rec[rows])
    close(state, s_rec)


def test_gate_formulas() -> None:
    gen = torch.Generator().manual_seed(9)
    raw = 10 * torch.randn(5, 3, 4, generator=gen)  # some inputs beyond softplus' threshold of 20
    a_log, dt_bias = torch.randn(1, 1, 3, 1, generator=gen), torch.randn(12, generator=gen)
    x = raw + dt_bias.view(3, 4)
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    a = a_log.view(3, 1).exp()
    close(kda_gate(raw, a_log, dt_bias), -a * softplus)
    close(kda_gate(raw, a_log.view(3), dt_bias, lower_bound=-5.0), -5.0 / (1 + torch.exp(-a * x)))
    assert kda_gate(raw.bfloat16(), a_log, None).dtype == torch.float32


def test_l2norm() -> None:
    x = torch.randn(4, 3, 8)
    close(l2norm(x), x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6))
    close(l2norm(x, eps=0.0), F.normalize(x, dim=-1))
    assert l2norm(x.bfloat16()).dtype == torch.bfloat16
