"""Grammar compilation under a time budget, in worker processes that can be killed.

Why processes, and why the scheduler still compiles: a grammar's compile time is unbounded in its source
(5,000 properties or 600 nested arrays take a minute against a large vocabulary) and a thread cannot be stopped,
so the first compile of every grammar runs in a small pool of worker processes (`--grammar-compile-workers`,
spawned at the first grammar, at a lower CPU priority). A worker that passes the budget
(`--grammar-compile-timeout`) is killed and replaced, and its request refused; one worker busy with a slow
grammar leaves the others to the cheap ones. The compiled grammar cannot come back: xgrammar 0.2.9 serialises
it only as JSON, ~90x its size and slower than compiling (a 4 MB grammar: 357 MB and 15 s). So a worker returns
what to compile (the schema already converted to EBNF, the conversion being the part that holds the GIL), and
the scheduler compiles that again in a thread: xgrammar's compile releases the GIL, so it competes for a core
only, never for the step loop's interpreter, and is known to end in about the time the worker took. The price
is compiling a grammar twice on its first use; the scheduler's cache (`runtime.grammar`) spares repeats both.

The pool is driven by one thread in the scheduler process that waits on the workers' pipes (no GIL held while
it waits) and resolves each request's Future. Workers are plain subprocesses (`python -m runtime.grammar_pool`)
talking over a multiprocessing pipe: the scheduler is a daemonic multiprocessing child, which multiprocessing
forbids to have children of its own.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

from runtime.errors import InvalidRequest
from runtime.grammar_compile import CompilerSetup, GrammarKey, Probed, build_compiler, probe

WORKER_NICE = 10  # workers yield the cores to the scheduler and the model workers


class _Reply(NamedTuple):
    probed: Probed | None  # None: refused
    message: str = ""
    param: str | None = None
    invalid: bool = True  # the grammar's fault (a 400), not the compiler's


_READY = "ready"


def _serve(conn: mpc.Connection) -> None:
    """A worker: read the setup, build the compiler, then probe the grammars sent until the pipe closes."""
    with contextlib.suppress(EOFError, OSError):  # the pipe closed: the scheduler is gone, so is this worker
        setup: CompilerSetup = conn.recv()  # first, before the slow imports: the pool's thread waits on this send
        with contextlib.suppress(OSError):
            os.nice(WORKER_NICE)
        compiler = build_compiler(setup, threads=1)
        conn.send(_READY)
        while True:
            key = conn.recv()
            try:
                reply = _Reply(probe(compiler, key))
            except InvalidRequest as e:
                reply = _Reply(None, e.message, e.param)
            except Exception as e:  # the compiler failing on a grammar it accepted
                reply = _Reply(None, f"{type(e).__name__}: {e}", key.kind, invalid=False)
            conn.send(reply)


@dataclass
class _Worker:
    proc: subprocess.Popen[bytes]
    conn: mpc.Connection
    ready: bool = False
    job: tuple[GrammarKey, Future[Probed]] | None = None
    deadline: float = 0.0


class CompilePool:
    """`submit(key)` -> Future of the key's `Probed`, or of InvalidRequest (refused, or past the budget)."""

    def __init__(self, setup: CompilerSetup, workers: int, timeout_s: float) -> None:
        self._setup = setup
        self._n = workers
        self.timeout_s = timeout_s
        self._jobs: deque[tuple[GrammarKey, Future[Probed]]] = deque()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._workers: list[_Worker] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self._broken: str | None = None  # a worker could not start: grammars fail with this
        self.killed = 0  # workers killed past the budget (or dead), for tests and logs

    def submit(self, key: GrammarKey) -> Future[Probed]:
        fut: Future[Probed] = Future()
        with self._lock:
            if self._closed or self._broken is not None:
                fut.set_exception(RuntimeError(self._broken or "the grammar compiler is shut down"))
                return fut
            self._jobs.append((key, fut))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grammar-pool", daemon=True)
                self._thread.start()
            self._wake_w.send_bytes(b"")
        return fut

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake_w.send_bytes(b"")
        if self._thread is not None:
            self._thread.join(10)
        for w in self._workers:
            self._stop(w)
        self._workers = []

    # --- the pool's thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve_jobs()
        except Exception as e:  # a bug here must fail the grammars waiting, never leave them pending
            self._broken = f"the grammar compiler failed: {type(e).__name__}: {e}"
        with self._lock:
            jobs, self._jobs = list(self._jobs), deque()
        jobs += [w.job for w in self._workers if w.job is not None]
        for _, fut in jobs:
            if not fut.done():
                fut.set_exception(RuntimeError(self._broken or "the grammar compiler is shut down"))

    def _serve_jobs(self) -> None:
        self._workers = [self._spawn() for _ in range(self._n)]
        while not self._closed and self._broken is None:
            self._dispatch()
            busy = [w.deadline for w in self._workers if w.job is not None]
            timeout = max(0.0, min(busy) - time.monotonic()) if busy else None
            for conn in mpc.wait([w.conn for w in self._workers] + [self._wake_r], timeout):
                if conn is self._wake_r:
                    while self._wake_r.poll():
                        self._wake_r.recv_bytes()
                else:
                    self._receive(next(w for w in self._workers if w.conn is conn))
            self._expire()

    def _spawn(self) -> _Worker:
        ours, theirs = mp.Pipe()
        proc = subprocess.Popen([sys.executable, "-m", "runtime.grammar_pool", str(theirs.fileno())],
                                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        ours.send(self._setup)
        return _Worker(proc, ours)

    def _dispatch(self) -> None:
        for w in self._workers:
            if not (w.ready and w.job is None):
                continue
            with self._lock:
                job = self._jobs.popleft() if self._jobs else None
            if job is None:
                return
            if not job[1].set_running_or_notify_cancel():
                continue
            w.job, w.deadline = job, time.monotonic() + self.timeout_s
            w.conn.send(job[0])

    def _receive(self, w: _Worker) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):  # the worker died: a grammar that crashed it, or killed from outside
            if not w.ready:  # it never started: starting another would fail alike, forever
                self._broken = f"the grammar compiler process failed to start (exit code {w.proc.poll()})"
                return
            self._replace(w, f"could not be compiled: the compiler process exited (code {w.proc.poll()})")
            return
        if msg == _READY:
            w.ready = True
            return
        assert w.job is not None, "a reply from an idle grammar worker"
        key, fut = w.job
        w.job = None
        if msg.probed is not None:
            fut.set_result(msg.probed)
        elif msg.invalid:
            fut.set_exception(InvalidRequest(msg.message, param=msg.param))
        else:
            fut.set_exception(RuntimeError(msg.message))

    def _expire(self) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if w.job is not None and now >= w.deadline:
                self._replace(w, f"did not compile within {self.timeout_s:g} s")

    def _replace(self, w: _Worker, why: str) -> None:
        """Kill `w` (its grammar refused with `why`) and start a fresh worker in its place."""
        if w.job is not None:
            key, fut = w.job
            fut.set_exception(InvalidRequest(f"the {key.kind} {why}", param=key.kind))
        self.killed += 1
        self._stop(w)
        self._workers[self._workers.index(w)] = self._spawn()

    @staticmethod
    def _stop(w: _Worker) -> None:
        w.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(5)
        w.conn.close()


if __name__ == "__main__":  # a worker: argv[1] is its end of the pipe
    # The module's own copy, not this __main__ one: what it sends must unpickle as runtime.grammar_pool's types.
    from runtime.grammar_pool import _serve as serve

    serve(mpc.Connection(int(sys.argv[1])))
