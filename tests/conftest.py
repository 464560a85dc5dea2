"""Fixtures shared across the test packages.

`spec_pair`: a trained speculation pair (a K3-format target with an MTP layer, a draft model and a DSpark
drafter), built by `bench/train_spec_pair.py`'s trainer at a small recipe on the shipped gsm8k train set, once
per session (seconds on a quiet machine), so that the trained-pair checks run everywhere instead of depending
on the bench's cached artifact. Its target is weak: greedy replies on gsm8k questions soon settle into a
repetition, which a trained drafter learns and a random one does not."""

from __future__ import annotations

import os

import pytest

from bench.train_spec_pair import Recipe, SpecPair, Stage, ensure_spec_pair, k3_config
from runtime.server_args import COMPILE_ENV

# Engines under test decode eagerly (compiling costs tens of seconds per batch-size bucket); the compiled step's
# own tests build it themselves. Set before any engine starts, so spawned workers inherit it.
os.environ.setdefault(COMPILE_ENV, "0")

SMALL_SPEC_RECIPE = Recipe(
    target=k3_config(64, 2, [2], 1, 32, 128, mtp=1),
    draft=k3_config(32, 2, [2], 1, 16, 64, mtp=0),
    target_stage=Stage(steps=40, lr=1e-2, batch=4),
    mtp_stage=Stage(steps=30, lr=1e-2, batch=4),
    draft_stage=Stage(steps=30, lr=1e-2, batch=4),
    dspark_steps=20,
    dspark_texts=16,
    seq_len=64,
    num_examples=200,
)


@pytest.fixture(scope="session")
def spec_pair(tmp_path_factory: pytest.TempPathFactory) -> SpecPair:
    got = ensure_spec_pair(recipe=SMALL_SPEC_RECIPE, cache_dir=tmp_path_factory.mktemp("spec_pair"))
    assert got.dspark is not None, "the DSpark trainer is part of the tree"
    return got
