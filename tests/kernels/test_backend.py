"""The dispatch point and the Triton launcher (interpreted for CPU tensors, whatever TRITON_INTERPRET says)."""

from __future__ import annotations

import os

import pytest
import torch
import triton.language as tl

from kernels.backend import ENV_VAR, kernel_backend
from kernels.triton_launch import _interpreted_library, _library_twins, kernel


def test_default_and_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert kernel_backend(torch.device("cpu")) == "torch"
    assert kernel_backend(torch.device("cuda")) == "triton"
    monkeypatch.setenv(ENV_VAR, "TRITON")
    assert kernel_backend(torch.device("cpu")) == "triton"
    monkeypatch.setenv(ENV_VAR, "torch")
    assert kernel_backend(torch.device("cuda")) == "torch"
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=ENV_VAR):
        kernel_backend(torch.device("cpu"))


@kernel
def _row_cumsum(x, y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    row = tl.program_id(0)
    v = tl.load(x + row * n + offs, mask=offs < n, other=0.0)
    tl.store(y + row * n + offs, tl.cumsum(v, axis=0) + tl.zeros([BLOCK], dtype=tl.float32), mask=offs < n)


def test_cpu_launch_is_interpreted_and_restores_the_library() -> None:
    x = torch.randn(3, 10)
    y = torch.empty_like(x)
    _row_cumsum[(3,)](x, y, 10, BLOCK=16)
    torch.testing.assert_close(y, x.cumsum(1))
    twins = _library_twins()
    # with TRITON_INTERPRET=1 at import, triton's library is interpreted already and nothing is swapped
    assert bool(twins) != bool(os.environ.get("TRITON_INTERPRET"))
    assert all(getattr(mod, name) is compiled for mod, name, compiled, _ in twins)
    with _interpreted_library():
        assert all(getattr(mod, name) is twin for mod, name, _, twin in twins)
    assert all(getattr(mod, name) is compiled for mod, name, compiled, _ in twins)
