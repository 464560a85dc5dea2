from __future__ import annotations

from collections.abc import Iterator

import pytest

import frontend_lang as sgl


@pytest.fixture(scope="session")
def runtime() -> Iterator[sgl.Runtime]:
    """The in-process backend on the built-in k3-tiny model."""
    with sgl.Runtime(mem_bytes=32 << 20) as rt:
        yield rt
