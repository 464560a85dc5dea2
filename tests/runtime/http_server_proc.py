"""The real HTTP server as a subprocess on a free loopback port, for the test_http_* files."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from runtime.topology import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    api_key: str | None = None

    def client(self, **kw: object) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, timeout=60.0, headers=headers, **kw)  # type: ignore[arg-type]

    def metrics(self) -> dict[str, float]:
        """The /metrics samples by name (labels kept in the name), as floats."""
        with self.client() as c:
            r = c.get("/metrics")
        r.raise_for_status()
        out: dict[str, float] = {}
        for line in r.text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Metrics once nothing runs or waits (aborts and finishes have reached the scheduler)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["radixk3_num_running_reqs"] == 0 and m["radixk3_num_queued_reqs"] == 0:
                return m
            assert time.monotonic() < deadline, f"not idle after {timeout}s: {m}"
            time.sleep(0.1)

    def child_pid(self, name: str) -> int:
        """The pid of the engine process the server runs under `name`, as `ps` shows it (the names of
        runtime.process_info: `radixk3-sched0`, `radixk3-w0-0`, ...)."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid), "-x", name], capture_output=True, text=True,
                             check=False).stdout.split()
        assert len(out) == 1, f"{len(out)} child processes named {name!r}"
        return int(out[0])

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def start_server(*flags: str, api_key: str | None = None, startup_timeout: float = 180.0,
                 stderr: Path | None = None, port: int | None = None) -> Server:
    """The server on `port` (default: a free one), once /health answers; its stderr goes to the file `stderr` if
    given."""
    port = free_port() if port is None else port
    argv = [sys.executable, "-m", "radixk3.launch_server", "--port", str(port), *flags]
    if api_key is not None:
        argv += ["--api-key", api_key]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    with open(stderr, "wb") if stderr is not None else contextlib.nullcontext() as err:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stderr=err)
    server = Server(f"http://127.0.0.1:{port}", proc, api_key)
    deadline = time.monotonic() + startup_timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} during startup")
        try:
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"the server did not start within {startup_timeout}s")
        time.sleep(0.25)


class SharedServers:
    """Servers shared by the test modules that need the same configuration, one per set of flags: each starts on
    first use (again if it has exited) and stops at the end of the session. Only for tests whose assertions hold
    whatever other modules sent before (metrics compared before and after, not from zero)."""

    def __init__(self) -> None:
        self._by_flags: dict[tuple[str, ...], Server] = {}

    def get(self, *flags: str) -> Server:
        server = self._by_flags.get(flags)
        if server is None or server.proc.poll() is not None:
            server = self._by_flags[flags] = start_server(*flags)
        return server

    def stop_all(self) -> None:
        servers, self._by_flags = list(self._by_flags.values()), {}
        for server in servers:
            server.stop()


@contextmanager
def running_server(*flags: str, api_key: str | None = None, stderr: Path | None = None) -> Iterator[Server]:
    server = start_server(*flags, api_key=api_key, stderr=stderr)
    try:
        yield server
    finally:
        server.stop()
