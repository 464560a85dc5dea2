"""The worker process's OpenMP wait: its spin count set before torch loads libgomp, unless the user chose one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.worker_main import OPENMP_SPIN_COUNT, openmp_waits


@pytest.mark.parametrize(("env", "expected"), [
    ({}, str(OPENMP_SPIN_COUNT)),
    ({"GOMP_SPINCOUNT": "7"}, "7"),  # the user's count
    ({"OMP_WAIT_POLICY": "active"}, None),  # the user's policy: libgomp derives the count from it
])
def test_the_spin_count_is_set_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                                      expected: str | None) -> None:
    monkeypatch.setattr(os, "environ", dict(env))
    openmp_waits()
    assert os.environ.get("GOMP_SPINCOUNT") == expected


def test_a_worker_sets_it_before_torch_loads() -> None:
    """What a spawned worker has imported when `worker_main` starts (its module, and what unpickling its
    arguments loads) must not include torch, whose import loads libgomp and fixes the spin count."""
    code = ("import sys, runtime.worker_main, runtime.server_args, runtime.topology; "
            "print('torch' in sys.modules)")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "False", "the worker's own imports load torch before its spin count is set"
