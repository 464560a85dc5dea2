"""The worker process's OpenMP wait: its spin count set unless the user chose one (that a worker sets it before
torch loads libgomp: `test_process_imports.py`)."""

from __future__ import annotations

import os

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
