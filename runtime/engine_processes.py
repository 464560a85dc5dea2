"""Starting, watching and stopping the scheduler and worker processes, independent of any event loop.

`EngineProcesses(args)` spawns the children, waits until every one is ready (or says why it failed) and
then watches them from a thread: a child that dies marks the engine dead, tells every registered listener
(the tokenizer manager fails its pending requests) and stops the others. The request path (`sched_in`,
`sched_out`) belongs to the tokenizer manager; this side keeps only the `ready` socket and a socket to send
`Shutdown` on.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import zmq

from radixk3.config import ModelConfig
from radixk3.tokenizer import Tokenizer
from runtime.errors import EngineError
from runtime.messages import Shutdown, WorkerReady, decode, encode
from runtime.processes import endpoint, model_config, scheduler_main, tokenizer_for, worker_main
from runtime.server_args import ServerArgs


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Spawn children without re-running the caller's main script in them.

    A spawned child normally imports the parent's `__main__` again (to unpickle what it defines), so a script
    that starts an Engine at top level, without `if __name__ == "__main__":`, would start one in every child.
    The children's entry points and arguments live in `runtime.*`, so they need nothing from `__main__`:
    while they start, `__main__` looks like an interactive session's (no `__file__`, no `__spec__`)."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class EngineProcesses:
    def __init__(self, args: ServerArgs, startup_timeout: float = 120.0) -> None:
        self.args = args
        try:  # the tokenizer side needs both: the vocabulary bounds every id at the door
            self.config: ModelConfig = model_config(args)
            self.tokenizer: Tokenizer = tokenizer_for(args)
        except Exception as e:
            raise EngineError(f"startup failed: {type(e).__name__}: {e}") from e
        self.ipc_dir = tempfile.mkdtemp(prefix="radixk3-")
        self.dead: EngineError | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._listeners: list[Callable[[EngineError], None]] = []
        self._ctx = zmq.Context()
        self._ready = self._ctx.socket(zmq.PULL)
        self._ready.setsockopt(zmq.LINGER, 0)
        self._ready.bind(endpoint(self.ipc_dir, "ready"))
        spawn = mp.get_context("spawn")
        self.procs = [
            spawn.Process(target=worker_main, args=(args, self.ipc_dir, 0), daemon=True, name="radixk3-worker-0"),
            spawn.Process(target=scheduler_main, args=(args, self.ipc_dir, 1), daemon=True, name="radixk3-scheduler"),
        ]
        self._control = self._ctx.socket(zmq.PUSH)  # Shutdown only; requests go through the tokenizer manager
        self._control.setsockopt(zmq.LINGER, 0)
        self._control.connect(endpoint(self.ipc_dir, "sched_in"))
        try:
            with _main_module_hidden():
                for p in self.procs:
                    p.start()
            self._wait_ready(startup_timeout)
        except BaseException:
            self.shutdown()
            raise
        self.watcher = threading.Thread(target=self._watch, daemon=True, name="radixk3-watcher")
        self.watcher.start()

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def endpoint(self, name: str) -> str:
        return endpoint(self.ipc_dir, name)

    # --- startup and watching --------------------------------------------------------------------------
    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        ready = 0
        while ready < 1:
            if self._ready.poll(200):
                msg = decode(self._ready.recv_multipart())
                if isinstance(msg, WorkerReady):
                    if msg.error is not None:
                        raise EngineError(f"startup failed: {msg.error}")
                    ready += 1
            if (dead := self.dead_child()) is not None:
                if self._ready.poll(1000):  # a failing child says why before it exits
                    msg = decode(self._ready.recv_multipart())
                    if isinstance(msg, WorkerReady) and msg.error is not None:
                        raise EngineError(f"startup failed: {msg.error}")
                raise EngineError(f"startup failed: {dead}")
            if time.monotonic() > deadline:
                raise EngineError(f"startup timed out after {timeout:.0f}s")

    def dead_child(self) -> str | None:
        for p in self.procs:
            if not p.is_alive():
                return f"process {p.name} exited with code {p.exitcode}"
        return None

    def _watch(self) -> None:
        sentinels = [p.sentinel for p in self.procs]
        while not self._closed:
            if not multiprocessing.connection.wait(sentinels, timeout=0.5) or self._closed:
                continue
            dead = self.dead_child()
            if dead is None:
                continue
            err = EngineError(f"{dead}; pending requests failed")
            with self._lock:
                if self._closed:
                    return
                self.dead = err
                listeners = list(self._listeners)
            for fn in listeners:
                fn(err)
            self.shutdown()
            return

    def on_death(self, fn: Callable[[EngineError], None]) -> None:
        """Call `fn(error)` (from the watcher thread) if a child dies; at once if one already has."""
        with self._lock:
            if self.dead is None:
                self._listeners.append(fn)
                return
        fn(self.dead)

    # --- shutdown --------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Ask the children to stop, give them a grace period, then terminate; remove the sockets' dir."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._control.send_multipart(encode(Shutdown()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        grace = 1.0 if self.dead is not None else 5.0  # a dead sibling means nobody will answer
        for p in self.procs:
            if p.pid is None:
                continue  # never started
            p.join(timeout=grace)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self._ctx.destroy(linger=0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    @property
    def closed(self) -> bool:
        return self._closed
