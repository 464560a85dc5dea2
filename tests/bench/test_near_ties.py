"""The race's judge of differing greedy tokens (`bench/llamacpp/near_ties.py`): on a random k3-tiny whose lm_head
gives two tokens the same row (an exact tie in any precision), choosing the twin is a near tie; choosing a token
well below the top is not; equal streams and one that only ends earlier are no divergence of choices."""

from __future__ import annotations

import copy

import torch
from greedy import greedy_reference

from bench.llamacpp.near_ties import Streams, differing, divergences, first_difference
from radixk3.config import preset
from radixk3.model import build_model


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert differing([[1, 2], [1, 2], [3]], [[1, 2], [1], [4]]) == 2


def test_a_twin_token_is_a_near_tie_and_a_low_one_is_not() -> None:
    model = build_model(preset("k3-tiny"), seed=3).float()
    prompt = list(range(20, 32))
    want = greedy_reference(model, prompt, 4)
    top = want[2]
    with torch.inference_mode():
        ids = torch.tensor([prompt + want[:2]])
        logits = model(ids)[0, -1]
        low = int(logits.argsort()[len(logits) // 2])  # a token far below the top
        twin = next(t for t in range(16, len(logits)) if t not in (top, low) and t not in want)
        model.lm_head.weight[twin] = model.lm_head.weight[top]
    assert greedy_reference(model, prompt, 4)[:2] == want[:2]  # the twin moves nothing before its position
    theirs = [want, want[:2] + [twin, 0], want[:2] + [low, 0], want[:3]]
    got = divergences(model, copy.deepcopy(model).double(), "b1", Streams([prompt] * 4, [want] * 4, theirs))
    assert [(d.sequence, d.position) for d in got] == [(1, 2), (2, 2)]
    tie, bug = got
    assert tie.ours == top and tie.theirs == twin and abs(tie.gap_fp32) < 1e-5 and tie.near_tie
    assert bug.theirs == low and bug.gap_fp32 > 0 and abs(bug.gap_fp32 - bug.gap_fp64) < 1e-4 and not bug.near_tie
