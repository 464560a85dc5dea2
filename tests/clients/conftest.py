"""One radixk3 server (the built-in model) for every client test of this package: each starts in seconds, and the
clients here only read from it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.runtime.http_server_proc import Server, running_server


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    with running_server() as s:
        yield s
