"""Sampling on both backends: greedy, penalties, the kept sets of top-k / top-p / min-p, the sampled
distribution, per-request seeds independent of the batch, and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.backend import ENV_VAR
from kernels.sampling import apply_penalties, sample
from kernels.sampling_columns import NEUTRAL, SamplingColumns
from kernels.sampling_tensors import SamplingTensors

V = 6


def row(**values: float | int | None) -> dict:
    """One row's parameters (what it leaves out is neutral)."""
    return {**NEUTRAL, **values}


def params(rows: list[dict]) -> SamplingTensors:
    return SamplingTensors.from_columns(SamplingColumns.from_rows(rows), "cpu")


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.9])


def kept_by_definition(r: dict) -> set[int]:
    z = (LOGITS / r["temperature"]).tolist()
    probs = torch.tensor(z).softmax(0).tolist()
    order = sorted(range(V), key=lambda i: -z[i])
    keep = set(order[: r["top_k"]] if r["top_k"] > 0 else order)
    mass, prefix = 0.0, set()
    for i in order:
        if mass >= r["top_p"]:
            break
        prefix.add(i)
        mass += probs[i]
    keep &= prefix
    return {i for i in keep if probs[i] >= r["min_p"] * max(probs)}


def draw_many(r: dict, n: int = 3000) -> torch.Tensor:
    return sample(LOGITS.expand(n, V).clone(), params([{**r, "seed": 1000 + i} for i in range(n)])).tokens


FILTERED = [
    row(top_k=2),
    row(top_p=0.7),
    row(min_p=0.3),
    row(temperature=0.5, top_k=4, top_p=0.9),
]


@pytest.mark.parametrize("r", FILTERED)
def test_draws_stay_in_and_cover_the_kept_set(r: dict) -> None:
    """Torch; the Triton path picks the same tokens (the last test)."""
    drawn = set(draw_many(r, 600).tolist())
    assert drawn == kept_by_definition(r)


def test_distribution_follows_softmax() -> None:
    n = 4000
    counts = torch.bincount(draw_many(row(temperature=0.8), n), minlength=V).float()
    expect = (LOGITS / 0.8).softmax(0) * n
    chi2 = float(((counts - expect) ** 2 / expect).sum())
    assert chi2 < 25.0, (counts, expect)  # 5 degrees of freedom: p ~ 1e-4; the seeds are fixed


def test_greedy_and_penalties(backend: str) -> None:
    logits = torch.tensor([[3.0, 2.9, -1.0, 0.5], [1.0, 2.0, 3.0, -2.0]])
    rows = params([
        row(temperature=0.0, repetition_penalty=2.0),
        row(temperature=0.0, frequency_penalty=0.6, presence_penalty=0.5),
    ])
    history = [[0], [2, 2]]
    pen = apply_penalties(logits, rows, history)
    expect = logits.clone()
    expect[0, 0] = 3.0 / 2.0
    expect[1, 2] = 3.0 - 0.6 * 2 - 0.5
    torch.testing.assert_close(pen, expect)
    res = sample(logits, rows, history)
    assert res.tokens.tolist() == [1, 1]
    neg = sample(torch.tensor([[-1.0, -1.5]]), params([row(temperature=0, repetition_penalty=2.0)]), [[0]])
    assert neg.tokens.tolist() == [1]  # a negative logit is multiplied: -2.0 < -1.5


def test_seeds_are_independent_of_the_batch(backend: str) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen)
    rows = [row(seed=s, step=3, top_p=0.95) for s in (7, 8, 9, 10, 11)]
    alone = [int(sample(logits[i : i + 1], params([rows[i]])).tokens[0]) for i in range(5)]
    assert sample(logits, params(rows)).tokens.tolist() == alone
    rev = sample(logits.flip(0), params(rows[::-1])).tokens.tolist()
    assert rev[::-1] == alone
    later = sample(logits, params([{**r, "step": 4} for r in rows])).tokens.tolist()
    assert later != alone  # a new step draws new numbers


def test_logprobs(backend: str) -> None:
    logits = torch.randn(3, 9, generator=torch.Generator().manual_seed(1))
    res = sample(logits, params([row(seed=1), row(temperature=0), row(seed=2)]), top_logprobs_num=3)
    lp = logits.log_softmax(-1)
    torch.testing.assert_close(res.logprobs, lp.gather(1, res.tokens[:, None])[:, 0])
    torch.testing.assert_close(res.top_logprobs, lp.topk(3, dim=-1).values)
    assert res.top_ids.shape == (3, 3) and res.tokens[1] == logits[1].argmax()
    assert math.isclose(float(res.top_logprobs[0].exp().sum()), float(lp[0].topk(3).values.exp().sum()))


def test_triton_picks_the_same_tokens_as_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 300, generator=gen) * 3
    rows = [
        row(seed=1, temperature=0.7),
        row(seed=2, top_k=5),
        row(seed=3, top_p=0.5, frequency_penalty=0.4),
        row(seed=4, min_p=0.1, repetition_penalty=1.3),
        row(temperature=0.0, presence_penalty=1.0),
        row(seed=2**40 + 5, step=9, temperature=1.3, top_k=50, top_p=0.9),
    ]
    history = [[1, 2], [], [5, 5, 7], [3], [logits[4].argmax().item()], [0]]
    # and the filtered rows above, 40 seeds each
    extra = [{**r, "seed": 50 + i} for r in FILTERED for i in range(40)]
    logits = torch.cat([logits, torch.nn.functional.pad(LOGITS, (0, 294), value=-30.0).expand(len(extra), -1)])
    tokens = []
    for be in ("torch", "triton"):
        monkeypatch.setenv(ENV_VAR, be)
        tokens.append(sample(logits, params(rows + extra), history + [[]] * len(extra)).tokens.tolist())
    assert tokens[0] == tokens[1]


def test_all_greedy_rows_take_the_first_maximum() -> None:
    """The all-greedy shortcut (no draw, no penalty) picks what the full path picks: the first of equal maxima."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, -1.0, 2.0], [-1.0, -2.0, 5.0, 5.0]])
    greedy = params([row(temperature=0.0)] * 3)
    assert sample(logits, greedy).tokens.tolist() == [1, 0, 2]
    mixed = params([row(temperature=0.0)] * 2 + [row(temperature=0.0, repetition_penalty=1.0 + 1e-9)])
    assert sample(logits, mixed, history=[[], [], [0]]).tokens.tolist() == [1, 0, 2]  # the full path
