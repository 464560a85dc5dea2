"""Speculative verification: greedy rows equal plain greedy decoding token for token; sampled rows emit
tokens distributed as the plain sampler's (chi-square against the distributions by definition, with a
negative control that the test rejects); seeded draws are reproducible and independent of the batch."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from kernels.sampling import LogitBias, TokenMask, sample
from kernels.sampling_columns import NEUTRAL, SamplingColumns
from kernels.sampling_tensors import SamplingTensors
from kernels.spec_sampling import verify_drafts

P_BOUND = 1e-4  # reject the distributions at this p-value; the seeds are fixed, so the outcome is too


def row(**values: float | int | None) -> dict:
    """One position's parameters (what it leaves out is neutral)."""
    return {**NEUTRAL, **values}


def params(rows: list[dict]) -> SamplingTensors:
    return SamplingTensors.from_columns(SamplingColumns.from_rows(rows), "cpu")


def positions(rows: list[list[dict]]) -> SamplingTensors:
    """Every window's positions (K+1 each), window after window: verify_drafts' row i * (K+1) + j."""
    return params([r for window in rows for r in window])


def greedy_chain(logits: Tensor, rows: list[dict], history: list[int], bans: list[list[int]],
                 drafts: list[int]) -> list[int]:
    """Plain greedy decoding with `sample()`, position by position, while the drafts match."""
    out: list[int] = []
    for j in range(len(drafts) + 1):
        t = int(sample(logits[j : j + 1], params([rows[j]]), [history + out], banned=[bans[j]]).tokens[0])
        out.append(t)
        if j == len(drafts) or drafts[j] != t:
            break
    return out


def test_greedy_equals_plain_greedy_decoding() -> None:
    gen = torch.Generator().manual_seed(0)
    n, k, vocab = 12, 4, 20
    logits = torch.randn(n, k + 1, vocab, generator=gen) * 2
    kinds = [
        row(temperature=0.0),
        row(temperature=0.0, repetition_penalty=1.8),
        row(top_k=1, frequency_penalty=0.7, presence_penalty=0.4, seed=3),
    ]
    rows, histories, bans, drafts, nds = [], [], [], [], []
    for i in range(n):
        base = kinds[i % 3]
        rows.append([{**base, "step": 5 + j} for j in range(k + 1)])
        histories.append(torch.randint(0, vocab, (i % 4,), generator=gen).tolist())
        bans.append([[int(logits[i, j].argmax())] if (i + j) % 5 == 0 else [] for j in range(k + 1)])
        nd = k - i % 3
        # the greedy continuation feeding itself, then one draft corrupted at a random place (or none)
        chain = greedy_chain(logits[i], rows[i], histories[i], bans[i], [-1] * nd)[:1]
        while len(chain) < nd:
            chain = greedy_chain(logits[i], rows[i], histories[i], bans[i], chain + [-1] * (nd - len(chain)))
        bad = int(torch.randint(0, nd + 2, (1,), generator=gen))
        if bad < nd:
            chain[bad] = (chain[bad] + 1 + int(torch.randint(0, vocab - 1, (1,), generator=gen))) % vocab
        drafts.append(chain + [-7] * (k - nd))  # entries past num_drafts are ignored, whatever they hold
        nds.append(nd)
    res = verify_drafts(logits, torch.tensor(drafts), torch.tensor(nds), positions(rows), histories, bans,
                        top_logprobs_num=2)
    lp = logits.log_softmax(-1)
    accepted = []
    for i in range(n):
        want = greedy_chain(logits[i], rows[i], histories[i], bans[i], drafts[i][: nds[i]])
        a = int(res.num_accepted[i])
        accepted.append(a)
        assert a == len(want) - 1 and res.tokens[i, : a + 1].tolist() == want, (i, want, res.tokens[i])
        assert (res.tokens[i, a + 1 :] == -1).all() and res.logprobs[i, a + 1 :].isnan().all()
        torch.testing.assert_close(res.logprobs[i, : a + 1], lp[i, range(a + 1), want])
    assert 0 in accepted and any(a == nd for a, nd in zip(accepted, nds, strict=True)) and len(set(accepted)) > 2
    torch.testing.assert_close(res.top_logprobs, lp.topk(2, dim=-1).values)


def test_greedy_with_a_grammar_mask() -> None:
    """The mask's rows index the flattened positions; a masked-out draft is rejected like any mismatch."""
    logits = torch.tensor([[[0.0, 3.0, 1.0, 2.0]] * 3])
    bits = torch.tensor([[0b1101], [0b1111], [0b0101]], dtype=torch.int32)  # position 0: no token 1
    mask = TokenMask(torch.tensor([0, 1, 2]), bits)
    rows = positions([[row(temperature=0.0, step=j) for j in range(3)]])
    res = verify_drafts(logits, torch.tensor([[3, 1]]), torch.tensor([2]), rows, mask=mask)
    assert res.num_accepted.tolist() == [2] and res.tokens.tolist() == [[3, 1, 2]]
    res = verify_drafts(logits, torch.tensor([[1, 1]]), torch.tensor([2]), rows, mask=mask)
    assert res.num_accepted.tolist() == [0] and res.tokens[0, 0] == 3


# The statistical test: V = 6, K = 2, the same target logits and drafter distributions in every row, one seed
# per row; the emitted token at position j, given the tokens before it, must follow p_j of that prefix.
V, K, ROWS = 6, 2, 20000
TARGET = torch.tensor([[1.5, 0.2, 0.9, -0.5, 0.6, 0.0], [0.1, 1.2, -0.3, 0.8, 0.8, -1.0],
                       [-0.4, 0.3, 1.1, 0.0, 0.5, 0.9]])
DRAFTER = torch.tensor([[0.5, 1.0, 0.0, 0.3, -0.5, 0.4], [0.9, 0.2, 0.2, 1.1, -0.2, 0.0]]).softmax(-1)
VARIANTS = [
    row(temperature=0.8),
    row(top_k=3),
    row(temperature=1.3, top_p=0.8),
    row(min_p=0.2, presence_penalty=0.7),
    row(temperature=0.7, top_k=4, top_p=0.9, repetition_penalty=1.5),
]
HISTORY = [2]


def dist_by_definition(r: dict, logits: Tensor, history: list[int]) -> Tensor:
    """p_j written out from the sampler's definition, independently of its code."""
    x = logits.tolist()
    for t in set(history):
        x[t] -= r["frequency_penalty"] * history.count(t) + r["presence_penalty"]
        x[t] = x[t] / r["repetition_penalty"] if x[t] > 0 else x[t] * r["repetition_penalty"]
    probs = (torch.tensor(x) / r["temperature"]).softmax(0)
    order = sorted(range(V), key=lambda i: -x[i])
    keep = set(order[: r["top_k"]] if r["top_k"] > 0 else order)
    mass, prefix = 0.0, set()
    for i in order:
        if mass >= r["top_p"]:
            break
        prefix.add(i)
        mass += float(probs[i])
    keep = {i for i in keep & prefix if probs[i] >= r["min_p"] * probs.max()}
    out = torch.zeros(V)
    out[list(keep)] = probs[list(keep)]
    return out / out.sum()


def run_batch(r: dict, point_mass: bool, seed0: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed0 + 1)
    drafts = torch.stack([torch.multinomial(DRAFTER[j], ROWS, replacement=True, generator=gen) for j in range(K)], 1)
    rows = positions([[{**r, "seed": seed0 + i, "step": 10 + j} for j in range(K + 1)] for i in range(ROWS)])
    q = None if point_mass else DRAFTER.expand(ROWS, K, V)
    res = verify_drafts(TARGET.expand(ROWS, K + 1, V), drafts, torch.full((ROWS,), K), rows, [HISTORY] * ROWS,
                        draft_probs=q)
    return res.tokens, res.num_accepted


def chi2_pvalue(r: dict, tokens: Tensor, num_accepted: Tensor) -> float:
    """Pooled chi-square over positions and prefixes (prefixes with enough rows for the approximation)."""
    chi2, dof = 0.0, 0
    for j in range(K + 1):
        reached = num_accepted >= j
        for prefix in {tuple(t) for t in tokens[reached, :j].tolist()}:
            sel = reached & (tokens[:, :j] == torch.tensor(prefix, dtype=torch.int64)).all(1)
            p = dist_by_definition(r, TARGET[j], HISTORY + list(prefix))
            got = torch.bincount(tokens[sel, j], minlength=V).float()
            assert (got[p == 0] == 0).all(), (r, j, prefix, got, p)  # never outside the kept set
            expect = p * sel.sum()
            if float(expect[p > 0].min()) < 5:
                continue
            chi2 += float(((got - expect)[p > 0] ** 2 / expect[p > 0]).sum())
            dof += int((p > 0).sum()) - 1
    assert dof > 0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-probs", "point-mass"])
@pytest.mark.parametrize("r", VARIANTS)
def test_emitted_tokens_follow_the_target_distribution(r: dict, point_mass: bool) -> None:
    tokens, num_accepted = run_batch(r, point_mass)
    assert int((num_accepted == K).sum()) > 200 and int((num_accepted == 0).sum()) > 200  # both branches, often
    assert chi2_pvalue(r, tokens, num_accepted) > P_BOUND


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-probs", "point-mass"])
def test_the_chi_square_test_can_fail(point_mass: bool) -> None:
    """Negative controls: accepting every draft, or drawing a rejected position from p instead of the
    residual, gives distributions the test rejects."""
    r = VARIANTS[0]
    tokens, num_accepted = run_batch(r, point_mass)
    gen = torch.Generator().manual_seed(1)
    drafts = torch.stack([torch.multinomial(DRAFTER[j], ROWS, replacement=True, generator=gen) for j in range(K)], 1)
    bonus = sample(TARGET[K].expand(ROWS, V).clone(), params([{**r, "seed": i} for i in range(ROWS)])).tokens
    always = torch.cat([drafts, bonus[:, None]], 1)
    assert chi2_pvalue(r, always, torch.full((ROWS,), K)) < P_BOUND
    rejected = num_accepted == 0
    plain = sample(TARGET[0].expand(ROWS, V).clone(), params([{**r, "seed": i, "step": 10} for i in range(ROWS)]),
                   [HISTORY] * ROWS).tokens
    wrong = tokens.clone()
    wrong[rejected, 0] = plain[rejected]
    assert chi2_pvalue(r, wrong, num_accepted) < P_BOUND


def test_reproducible_and_independent_of_the_batch() -> None:
    gen = torch.Generator().manual_seed(5)
    n, vocab = 6, 40
    logits = torch.randn(n, K + 1, vocab, generator=gen)
    drafts = logits[:, :K].argmax(-1)  # likely drafts, so that some are accepted and later positions drawn
    nds = torch.tensor([2, 2, 1, 0, 2, 2])
    rows = [[row(seed=100 + i, step=3 + j, top_p=0.95) for j in range(K + 1)] for i in range(n)]
    rows[4] = [{**r, "temperature": 0.0} for r in rows[4]]  # a greedy row among sampled ones
    first = verify_drafts(logits, drafts, nds, positions(rows))
    again = verify_drafts(logits, drafts, nds, positions(rows))
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.num_accepted, again.num_accepted)
    alone = [verify_drafts(logits[i : i + 1], drafts[i : i + 1], nds[i : i + 1], positions(rows[i : i + 1])).tokens[0]
             for i in range(n)]
    assert torch.equal(torch.stack(alone), first.tokens)
    assert first.tokens[4, : int(first.num_accepted[4]) + 1].tolist() == logits[4].argmax(-1).tolist()[
        : int(first.num_accepted[4]) + 1]
    reseeded = [[{**r, "seed": r["seed"] + 1000} for r in req] for req in rows]
    assert not torch.equal(verify_drafts(logits, drafts, nds, positions(reseeded)).tokens, first.tokens)


def test_drafts_from_the_target_itself_are_all_accepted() -> None:
    """q = p: the accept ratio is 1, every draft stays."""
    n = 500
    r = row(temperature=0.9, top_k=4)
    p = torch.stack([dist_by_definition(r, TARGET[j], []) for j in range(K)])
    gen = torch.Generator().manual_seed(2)
    drafts = torch.stack([torch.multinomial(p[j], n, replacement=True, generator=gen) for j in range(K)], 1)
    rows = positions([[{**r, "seed": i, "step": j} for j in range(K + 1)] for i in range(n)])
    res = verify_drafts(TARGET.expand(n, K + 1, V), drafts, torch.full((n,), K), rows, draft_probs=p.expand(n, K, V))
    assert float((res.num_accepted == K).float().mean()) > 0.99
    assert math.isfinite(float(res.logprobs.sum()))


def test_greedy_fast_path_equals_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain greedy rows take the argmax-compare fast path; forcing the full sampler path gives the same result
    (drafts accepted at random places, ties in the logits, short windows)."""
    import kernels.spec_sampling as ss

    gen = torch.Generator().manual_seed(4)
    n, k, vocab = 9, 5, 16
    logits = (torch.randn(n, k + 1, vocab, generator=gen) * 2).round()  # rounding makes ties
    own = logits.argmax(-1)
    drafts = own[:, :k].clone()
    for i in range(n):  # corrupt one draft (or none) per row
        j = i % (k + 1)
        if j < k:
            drafts[i, j] = (drafts[i, j] + 1) % vocab
    nds = torch.tensor([k - i % 3 for i in range(n)])
    rows = positions([[row(temperature=0.0, step=j) if i % 2 else row(top_k=1, step=j)
                       for j in range(k + 1)] for i in range(n)])
    assert ss.plain_greedy(rows, [[[]] * (k + 1)] * n, None)
    fast = verify_drafts(logits, drafts, nds, rows, top_logprobs_num=3)
    monkeypatch.setattr(ss, "plain_greedy", lambda *a: False)
    slow = verify_drafts(logits, drafts, nds, rows, top_logprobs_num=3)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a.nan_to_num(-9.0), b.nan_to_num(-9.0))
    assert int(fast.num_accepted.sum()) > 0 and int((fast.num_accepted < nds).sum()) > 0


def test_fast_path_only_for_rows_without_logit_changes() -> None:
    from kernels.spec_sampling import plain_greedy

    g = positions([[row(temperature=0.0)] * 2])
    assert plain_greedy(g, None, None) and plain_greedy(g, [[[], []]], None)
    assert not plain_greedy(g, [[[], [3]]], None)  # a ban
    assert not plain_greedy(g, None, TokenMask(torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int32)))
    assert not plain_greedy(positions([[row(temperature=0.0, repetition_penalty=1.2)]]), None, None)
    assert not plain_greedy(positions([[row(temperature=0.7)]]), None, None)


def test_a_logit_bias_verifies_as_the_plain_sampler_draws() -> None:
    gen = torch.Generator().manual_seed(7)
    n, k, vocab = 4, 3, 12
    logits = torch.randn(n, k + 1, vocab, generator=gen) * 2
    window_bias = {0: [(2, 5.0), (5, -3.0)], 2: [(int(logits[2, 0].argmax()), -40.0)]}
    drafts = logits[:, :k].argmax(-1)  # the unbiased picks: a biased window rejects where its bias changes one
    bias = LogitBias.of([(i * (k + 1) + j, t, b) for i, pairs in window_bias.items() for j in range(k + 1)
                         for t, b in pairs], "cpu")
    rows = positions([[row(temperature=0.0, step=j) for j in range(k + 1)] for _ in range(n)])
    res = verify_drafts(logits, drafts, torch.full((n,), k), rows, bias=bias)
    for i in range(n):
        mine = LogitBias.of([(0, t, b) for t, b in window_bias.get(i, [])], "cpu")
        want: list[int] = []
        for j in range(k + 1):
            want.append(int(sample(logits[i, j : j + 1], params([row(temperature=0.0)]), bias=mine).tokens[0]))
            if j == k or int(drafts[i, j]) != want[-1]:
                break
        assert res.tokens[i, : len(want)].tolist() == want and int(res.num_accepted[i]) == len(want) - 1
    assert res.num_accepted.tolist()[1::2] == [k, k] and min(res.num_accepted.tolist()[0::2]) < k
    # The logprobs stay the raw distribution's.
    assert torch.equal(res.logprobs[0, 0], logits[0, 0].log_softmax(-1)[res.tokens[0, 0]])
