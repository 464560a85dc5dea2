"""The watchdog (issue 27) through the real HTTP server: a worker rank or the scheduler stopped (SIGSTOP: alive,
and doing nothing) with requests in flight. Every request fails with an error naming the stuck process within
--watchdog-timeout plus a margin; meanwhile /health is 503 naming it, /metrics answers with a staleness value
and new requests are refused; after SIGCONT the engine serves again, exactly, with its pool back to baseline."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import orjson

from tests.runtime.http_server_proc import Server, running_server

WATCHDOG_S = 3.0
WATCHDOG = ("--watchdog-timeout", str(WATCHDOG_S))
MARGIN_S = 20.0  # generous: this machine is shared, and a test only bounds what the watchdog promises
IN_FLIGHT = 20
LONG = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}
GREEDY = {"max_new_tokens": 8, "temperature": 0}
PROMPT = "Natalia sold clips to 48 of her friends"
STALENESS = "radixk3_scheduler_metrics_staleness_seconds"
POOL = ("radixk3_state_pool_used_bytes", "radixk3_kv_pool_used_bytes")


class _Stream(threading.Thread):
    """One long streamed request; `error` is the message of the error it ended with."""

    def __init__(self, server: Server, i: int) -> None:
        super().__init__(daemon=True)
        self.server, self.i = server, i
        self.started = threading.Event()
        self.error: str | None = None
        self.ended_at: float | None = None

    def run(self) -> None:
        body = {"input_ids": list(range(20 + self.i, 60 + self.i)), "sampling_params": LONG, "stream": True}
        with self.server.client() as c, c.stream("POST", "/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = orjson.loads(line[6:])
                    self.started.set()
                    if "error" in event:
                        self.error = event["error"]["message"]
        self.ended_at = time.monotonic()


def _greedy(server: Server) -> list[int]:
    with server.client() as c:
        r = c.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _healthy(server: Server, within: float) -> None:
    deadline = time.monotonic() + within
    with server.client() as c:
        while (r := c.get("/health")).status_code != 200:
            assert time.monotonic() < deadline, f"not healthy after {within}s: {r.text}"
            time.sleep(0.2)


def _pool_after_flush(server: Server) -> tuple[float, ...]:
    server.wait_idle()
    with server.client() as c:
        assert c.post("/flush_cache").status_code == 200
    m = server.metrics()
    return tuple(m[k] for k in POOL)


def _warm(server: Server) -> tuple[list[int], tuple[float, ...]]:
    """The greedy output and the pool's bytes after a flush, once the engine is warm: a cold first step may
    overrun this short timeout (the watchdog fires, and the engine recovers by itself when the step ends)."""
    deadline = time.monotonic() + 120
    while True:
        _healthy(server, 120)
        with server.client() as c:
            r = c.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY})
        if r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "length":
            break
        assert time.monotonic() < deadline, r.text
    return r.json()["output_ids"], _pool_after_flush(server)


@contextmanager
def _stopped(pid: int) -> Iterator[float]:
    """The process stopped (a hang) for the block's duration; yields when."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        os.kill(pid, signal.SIGCONT)


def _in_flight(server: Server) -> list[_Stream]:
    """IN_FLIGHT long requests, each producing. On this shared machine a step may overrun the short timeout
    before anything is stopped (the watchdog then fails them all, and the engine recovers): start again."""
    for _ in range(5):
        streams = [_Stream(server, i) for i in range(IN_FLIGHT)]
        for s in streams:
            s.start()
        for s in streams:
            assert s.started.wait(120), "a request produced nothing"
        if all(s.error is None for s in streams):
            return streams
        for s in streams:
            s.join(60)
        _healthy(server, 120)
    raise AssertionError(f"steps overran the watchdog every time: {[s.error for s in streams if s.error][:1]}")


def _all_fail(streams: list[_Stream], since: float, *words: str) -> None:
    bound = WATCHDOG_S + MARGIN_S
    for s in streams:
        s.join(timeout=max(0.0, since + bound - time.monotonic()))
        assert not s.is_alive(), f"a request still hangs {bound}s after the stop"
        assert s.ended_at is not None and s.ended_at - since < bound
        assert s.error is not None and all(w in s.error for w in words), s.error


def _stuck_meanwhile(server: Server, *words: str) -> None:
    with server.client() as c:
        health = c.get("/health")
        assert health.status_code == 503, health.text
        message = health.json()["error"]["message"]
        assert "stuck" in message and all(w in message for w in words), message
        metrics = c.get("/metrics")
        assert metrics.status_code == 200, metrics.text
        assert f"\n{STALENESS} " in metrics.text
        refused = c.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY})
        assert refused.status_code == 503 and "stuck" in refused.json()["error"]["message"], refused.text


def _serves_again(server: Server, before: list[int], pool: tuple[float, ...]) -> None:
    _healthy(server, 60)
    assert _greedy(server) == before
    assert _pool_after_flush(server) == pool  # no block leaked
    assert server.metrics()[STALENESS] == 0


def test_a_stopped_worker_fails_its_requests_and_the_engine_recovers() -> None:
    with running_server(*WATCHDOG) as server:
        before, pool = _warm(server)
        worker = server.child_pid("radixk3-w0-0")
        streams = _in_flight(server)
        with _stopped(worker) as since:
            _all_fail(streams, since, "worker rank 0 of replica 0", f"(pid {worker}) is stopped", "--watchdog-timeout")
            _stuck_meanwhile(server, "worker rank 0 of replica 0")
            assert server.metrics()[STALENESS] == 0  # the scheduler still answers
        _serves_again(server, before, pool)


def test_a_stopped_scheduler_fails_its_requests_and_the_engine_recovers() -> None:
    """After SIGCONT the scheduler carries on: it drops the requests failed meanwhile (the aborts the tokenizer
    side sent them), frees their memory and serves again."""
    with running_server(*WATCHDOG) as server:
        before, pool = _warm(server)
        scheduler = server.child_pid("radixk3-sched0")
        server.metrics()  # fresh values, to go stale
        streams = _in_flight(server)
        with _stopped(scheduler) as since:
            _all_fail(streams, since, f"the scheduler of replica 0 (pid {scheduler}, stopped)", "--watchdog-timeout")
            _stuck_meanwhile(server, "the scheduler of replica 0")
            assert server.metrics()[STALENESS] > 0  # the last values known, served at once
        _serves_again(server, before, pool)
