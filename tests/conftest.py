"""Fixtures shared across the test packages.

`shared_servers` / `default_server` and `builtin_engine`: one HTTP server (a subprocess per configuration) and one
multi-process Engine for the whole session, shared by the modules whose assertions hold whatever other modules
sent before (their own requests' outputs, metrics compared before and after): each start costs seconds of
process spawning and model loading.

`spec_pair`: a trained speculation pair (a K3-format target with an MTP layer, a draft model and a DSpark
drafter), built by `bench/train_spec_pair.py`'s trainer at a small recipe on the shipped gsm8k train set, once
per session (seconds on a quiet machine), so that the trained-pair checks run everywhere instead of depending
on the bench's cached artifact. Its target is weak: greedy replies on gsm8k questions soon settle into a
repetition, which a trained drafter learns and a random one does not."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from bench.train_spec_pair import Recipe, SpecPair, Stage, ensure_spec_pair, k3_config
from radixk3.builtin_model import DEFAULT_MODEL_ENV
from radixk3.config import TINY_PRESET
from runtime.server_args import COMPILE_ENV
from tests.runtime.http_server_proc import Server, SharedServers

if TYPE_CHECKING:
    from runtime.tokenizer.engine import Engine

# Engines under test decode eagerly (compiling costs tens of seconds per batch-size bucket); the compiled step's
# own tests build it themselves. Set before any engine starts, so spawned workers inherit it.
os.environ.setdefault(COMPILE_ENV, "0")
# An engine given no model serves the random k3-tiny preset here (every feature, test-sized; the built-in trained
# model is dense), spawned servers included; the tests of the built-in model name its directory.
os.environ[DEFAULT_MODEL_ENV] = TINY_PRESET
# The suite runs in pytest-xdist workers, one per core (pyproject's addopts): each worker's own forwards get an
# equal share of the cores, so that two workers' OpenMP teams do not spin against each other. The engines and
# servers the tests spawn size their own teams from the cores, so beside the other worker their threads outnumber
# the cores, and a thread spinning at a barrier holds a core the thread it waits for needs: they wait passively
# (four of the heaviest files on 2 cores: 0.7x the time, 0.6x the CPU). Set before any engine starts, so spawned
# processes inherit it (this worker's libgomp read its settings when torch loaded). An OMP_WAIT_POLICY or
# GOMP_SPINCOUNT already set wins.
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "passive"

SMALL_SPEC_RECIPE = Recipe(
    target=k3_config(64, 2, [2], 1, 32, 128, mtp=1),
    draft=k3_config(32, 2, [2], 1, 16, 64, mtp=0),
    target_stage=Stage(steps=40, lr=1e-2, batch=4),
    mtp_stage=Stage(steps=30, lr=1e-2, batch=4),
    draft_stage=Stage(steps=30, lr=1e-2, batch=4),
    dspark_stage=Stage(steps=20, lr=1e-2, batch=1),
    seq_len=64,
    num_examples=200,
)


@pytest.fixture(scope="session")
def spec_pair(tmp_path_factory: pytest.TempPathFactory) -> SpecPair:
    got = ensure_spec_pair(recipe=SMALL_SPEC_RECIPE, cache_dir=tmp_path_factory.mktemp("spec_pair"))
    assert got.dspark is not None, "the DSpark trainer is part of the tree"
    return got


@pytest.fixture(scope="session")
def shared_servers() -> Iterator[SharedServers]:
    """HTTP servers (subprocesses) shared across test modules by configuration: a server start is seconds."""
    servers = SharedServers()
    try:
        yield servers
    finally:
        servers.stop_all()


@pytest.fixture(scope="module")
def default_server(shared_servers: SharedServers) -> Server:
    """The server on the built-in model with default flags, for every module that only needs that: one for the
    session, started again for the next module should it have exited."""
    return shared_servers.get()


@pytest.fixture(scope="session")
def builtin_engine() -> Iterator[Engine]:
    """The multi-process Engine on the default model (k3-tiny here; 8 MiB pool), shared by the modules whose tests
    hold whatever ran on it before: each checks only its own requests, or flushes the cache first where it counts
    hits."""
    from runtime.tokenizer.engine import Engine  # the engine's imports only for the tests that use it

    with Engine(mem_bytes=8 << 20) as engine:
        yield engine


@pytest.fixture(scope="session")
def vision_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A K3 checkpoint with a small random vision tower, as `radixk3 make-checkpoint --vision` writes it."""
    from radixk3.cli import main

    out = tmp_path_factory.mktemp("k3_vision") / "ck"
    assert main(["make-checkpoint", "--preset", "k3-tiny-native", "--tokenizer", "tiktoken", "--vision",
                 "--seed", "5", str(out)]) == 0
    return out

