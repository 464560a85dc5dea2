"""Every client test of this package uses the session's server on the built-in model (tests/conftest.py's
`default_server`): the clients here only read from it."""

from __future__ import annotations

import pytest

from tests.runtime.http_server_proc import Server


@pytest.fixture(scope="module")
def server(default_server: Server) -> Server:
    return default_server
