"""Kernel tests: make this folder's helper modules (seeded inputs) importable by name; the `backend` fixture."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kernels.backend import ENV_VAR

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(params=["torch", "triton"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(ENV_VAR, request.param)
    return request.param
