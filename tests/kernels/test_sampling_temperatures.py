"""Extreme temperatures, on both sampling backends and in speculative verification: below 1e-5 a row is greedy
(the argmax, whatever its seed); at and above it the draw is computed in log-space, so no temperature makes inf or
NaN (not even with huge logits); a huge temperature draws uniformly over the kept set."""

from __future__ import annotations

import pytest
import torch
from test_spec_sampling import chi2_pvalue, run_batch

from kernels.sampling import sample
from kernels.sampling_columns import NEUTRAL, SamplingColumns
from kernels.sampling_tensors import GREEDY_BELOW, SamplingTensors, tempered
from kernels.spec_sampling import verify_drafts

TINY = [1e-45, 1e-38, 1e-6]
# The argmax (2) is not the first token, so that a tie among overflowed infs (which the first index wins) shows.
LOGITS = torch.tensor([0.9, 1.0, 2.0, 0.5, 0.0, -1.0])
V = LOGITS.numel()


def params(rows: list[dict]) -> SamplingTensors:
    return SamplingTensors.from_columns(SamplingColumns.from_rows([{**NEUTRAL, **r} for r in rows]), "cpu")


FILTERS = [{}, {"top_k": 3}, {"top_p": 0.9}, {"min_p": 0.1}, {"top_k": 4, "top_p": 0.8, "min_p": 0.05}]


def rows_at(temperature: float, seeds: int = 8) -> list[dict]:
    return [{"temperature": temperature, "seed": s, "step": s % 3, **f} for f in FILTERS for s in range(seeds)]


@pytest.mark.parametrize("temperature", TINY)
def test_tiny_temperatures_draw_the_argmax(backend: str, temperature: float) -> None:
    rows = rows_at(temperature)
    for scale in (1.0, 1e3, 1e30):  # huge logits: their quotient by a tiny T is far past float32's range
        logits = (LOGITS * scale).expand(len(rows), V).clone()
        res = sample(logits, params(rows), top_logprobs_num=2)
        assert res.tokens.tolist() == [2] * len(rows), (scale, res.tokens.tolist())
        assert torch.isfinite(res.logprobs).all() and torch.isfinite(res.top_logprobs).all()


def test_the_threshold_is_greedy_below_and_sampled_at() -> None:
    p = params([{"temperature": GREEDY_BELOW * 0.999}, {"temperature": GREEDY_BELOW}, {"temperature": 0.0}])
    assert p.greedy.tolist() == [True, False, True]


@pytest.mark.parametrize("scale", [1.0, 1e30])
def test_the_threshold_temperature_samples_without_overflow(backend: str, scale: float) -> None:
    """At T = 1e-5 the row samples; its z = (x - max x) / T stays finite at the top (huge logits included),
    and with logits this far apart the draw is the argmax."""
    rows = rows_at(GREEDY_BELOW)
    logits = (LOGITS * scale).expand(len(rows), V).clone()
    z = tempered(logits, params(rows))
    assert not z.isnan().any() and (z.amax(-1) == 0).all() and (z <= 0).all()
    assert sample(logits, params(rows)).tokens.tolist() == [2] * len(rows)


def uniformity_chi2(tokens: torch.Tensor, kept: list[int]) -> float:
    counts = torch.bincount(tokens, minlength=V).float()
    assert counts.sum() == counts[kept].sum(), counts  # never outside the kept set
    expect = len(tokens) / len(kept)
    return float(((counts[kept] - expect) ** 2 / expect).sum())


# (filter, the kept set at an infinite temperature): every probability is then 1/6, top-p keeps the prefix whose
# mass before it is below top_p (4 tokens for 0.6), by logit; min-p keeps everything.
HOT = [({}, [0, 1, 2, 3, 4, 5]), ({"top_k": 3}, [0, 1, 2]), ({"top_p": 0.6}, [0, 1, 2, 3]),
       ({"min_p": 0.9}, [0, 1, 2, 3, 4, 5])]


@pytest.mark.parametrize(("filt", "kept"), HOT)
def test_a_huge_temperature_is_uniform_over_the_kept_set(filt: dict, kept: list[int]) -> None:
    n = 3000
    rows = [{"temperature": 1e6, "seed": 500 + i, **filt} for i in range(n)]
    tokens = sample(LOGITS.expand(n, V).clone(), params(rows)).tokens
    chi2 = uniformity_chi2(tokens, kept)
    assert chi2 < 25.0, (filt, torch.bincount(tokens, minlength=V))  # <= 5 degrees of freedom: p < 1e-4


def test_the_uniformity_check_can_fail() -> None:
    """Negative control: at temperature 1 the same draws are far from uniform."""
    n = 3000
    tokens = sample(LOGITS.expand(n, V).clone(), params([{"seed": 500 + i} for i in range(n)])).tokens
    assert uniformity_chi2(tokens, list(range(V))) > 25.0


def test_triton_equals_torch_at_extreme_temperatures(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels.backend import ENV_VAR

    rows = [r for t in (*TINY, GREEDY_BELOW, 1e6) for r in rows_at(t, seeds=3)]
    logits = torch.randn(len(rows), 40, generator=torch.Generator().manual_seed(3)) * 4
    tokens = []
    for be in ("torch", "triton"):
        monkeypatch.setenv(ENV_VAR, be)
        tokens.append(sample(logits, params(rows)).tokens.tolist())
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("temperature", [*TINY, GREEDY_BELOW])
def test_verification_at_tiny_temperatures_is_greedy(temperature: float) -> None:
    """Drafts equal to the argmax are all accepted and the bonus is the argmax; a wrong draft is rejected
    and replaced by the argmax; nothing is NaN (point-mass drafts and a drafter's distribution alike)."""
    k, n = 2, 2
    logits = (LOGITS * 1e30).expand(n, k + 1, V).clone()
    drafts = torch.tensor([[2, 2], [4, 2]])
    rows = params([{"temperature": temperature, "seed": 9 + i, "step": j} for i in range(n) for j in range(k + 1)])
    for q in (None, torch.full((n, k, V), 1.0 / V)):
        res = verify_drafts(logits, drafts, torch.tensor([k, k]), rows, draft_probs=q)
        assert res.num_accepted.tolist() == [2, 0]
        assert res.tokens.tolist() == [[2, 2, 2], [2, -1, -1]]
        assert torch.isfinite(res.logprobs[0]).all()


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-probs", "point-mass"])
def test_verification_at_a_huge_temperature_follows_the_target(point_mass: bool) -> None:
    """The spec chi-square (tests/kernels/test_spec_sampling.py) at T = 1e6 with top-k."""
    r = {**NEUTRAL, "temperature": 1e6, "top_k": 4}
    tokens, num_accepted = run_batch(r, point_mass)
    assert chi2_pvalue(r, tokens, num_accepted) > 1e-4
