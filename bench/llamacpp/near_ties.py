"""Where two fp32 backends' greedy tokens part: a conversion bug, or a near tie that fp32 itself cannot order.

At the first new token where two streams differ, the checkpoint's no-cache forward (radixk3's ground truth) runs
over the prompt and the tokens both share, in float32 and in float64. If fp32's error on the two candidates' logit
gap (the fp32 gap against the float64 one, plus a few ulps of the largest logit) is at least the gap itself, fp32
cannot order the two tokens, and two correct fp32 implementations summing in other orders may take either: a near
tie. Otherwise one side computes another model: a bug to find (a conversion's, most likely). The race compares
tokens only; this tells the two apart for the sequences that differ.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

Prompts = list[list[int]]
ULPS = 4  # fp32 ulps of the largest logit added to the gap's error: two orders of one sum differ by a few


class Divergence(NamedTuple):
    """One sequence's first differing new token (`position`), and the two choices' logit gaps there."""

    workload: str
    sequence: int
    position: int
    ours: int
    theirs: int
    gap_fp32: float  # logit[ours] - logit[theirs], the no-cache forward in float32
    gap_fp64: float  # the same in float64
    near_tie: bool  # |gap_fp32| <= |gap_fp32 - gap_fp64| + ULPS ulps of the largest logit: fp32's error covers it


class Streams(NamedTuple):
    """One workload's prompts and the two backends' greedy outputs for them."""

    prompts: Prompts
    ours: Prompts
    theirs: Prompts


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where a and b differ (one ending early counts from there), or None if equal."""
    n = min(len(a), len(b))
    k = next((i for i in range(n) if a[i] != b[i]), n)
    return None if k == n and len(a) == len(b) else k


def differing(ours: Prompts, theirs: Prompts) -> int:
    """How many sequences differ at all (a stream that only ends earlier included)."""
    return sum(first_difference(a, b) is not None for a, b in zip(ours, theirs, strict=True))


def divergences(model: torch.nn.Module, model64: torch.nn.Module, workload: str, streams: Streams) -> list[Divergence]:
    """Each differing sequence's first divergence, judged by `model` (an fp32 `KimiForCausalLM`) and `model64` (the
    same in float64). A sequence where one stream only ends earlier is not a divergence of choices and is skipped
    (so fewer divergences than `differing` sequences: something other than a choice differs)."""
    out: list[Divergence] = []
    for i, (prompt, a, b) in enumerate(zip(*streams, strict=True)):
        k = first_difference(a, b)
        if k is None or k >= min(len(a), len(b)):
            continue
        ids = torch.tensor([list(prompt) + list(a[:k])])
        with torch.inference_mode():
            l32 = model(ids)[0, -1].double()
            l64 = model64(ids)[0, -1]
        g32, g64 = float(l32[a[k]] - l32[b[k]]), float(l64[a[k]] - l64[b[k]])
        ulps = ULPS * 2.0**-24 * float(l32.abs().max())
        out.append(Divergence(workload, i, k, a[k], b[k], g32, g64, abs(g32) <= abs(g32 - g64) + ulps))
    return out


def judge(checkpoint: Path, workloads: dict[str, Streams]) -> list[Divergence]:
    """`divergences` of every workload, the checkpoint's model loaded once in fp32 and float64 (only when some
    sequence differs)."""
    if not any(differing(w.ours, w.theirs) for w in workloads.values()):
        return []
    from radixk3.checkpoint import load_model

    model = load_model(checkpoint).float()
    model64 = copy.deepcopy(model).double()
    return [d for name, w in workloads.items() for d in divergences(model, model64, name, w)]
