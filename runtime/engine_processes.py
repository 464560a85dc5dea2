"""Starting, watching and stopping the scheduler and worker processes, independent of any event loop.

`EngineProcesses(args)` spawns the children, waits until every one is ready (or says why it failed) and
then watches them from a thread: a child that dies marks the engine dead, tells every registered listener
(the tokenizer manager fails its pending requests) and stops the others. The request path (`sched_in`,
`sched_out`) belongs to the tokenizer manager; this side keeps only the `ready` socket and a socket to send
`Shutdown` on. The ranks' readiness says how big a pool they allocated (`pool_bytes`, sized by the workers
after their weights load), which bounds a request's tokens on the tokenizer side.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import zmq

from radixk3.config import ModelConfig
from radixk3.tokenizer import Tokenizer
from runtime.errors import EngineError
from runtime.messages import RankFailed, Shutdown, WorkerReady, decode, encode
from runtime.model_files import model_config, sampling_defaults, tokenizer_for
from runtime.process_info import is_stopped
from runtime.scheduler_main import scheduler_main
from runtime.server_args import ServerArgs
from runtime.sockets import endpoint
from runtime.tokenizer.chat_format import ChatFormat, chat_format_for
from runtime.topology import COLLECTIVE_FAILED_EXIT, RankId, Topology, rank_label, rank_process_name
from runtime.worker_main import worker_main


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Spawn children without re-running the caller's main script in them.

    A spawned child normally imports the parent's `__main__` again (to unpickle what it defines), so a script
    that starts an Engine at top level, without `if __name__ == "__main__":`, would start one in every child.
    The children's entry points and arguments live in `runtime.*`, so they need nothing from `__main__`:
    while they start, `__main__` looks like an interactive session's (no `__file__`, no `__spec__`). A worker
    also sets how its OpenMP threads wait before it loads torch (`worker_main.openmp_waits`), which a main script
    that imports torch would preempt."""
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


def _signal_name(exitcode: int | None) -> str:
    """" (SIGKILL)" for a process a signal ended, else ""."""
    if exitcode is None or exitcode >= 0:
        return ""
    try:
        return f" ({signal.Signals(-exitcode).name})"
    except ValueError:
        return ""


# Each batch-size bucket of the compiled decode step compiles before its worker says it is ready: minutes on a
# small CPU for a small model, so the startup timeout grows by this much per bucket.
COMPILE_SECONDS_PER_BUCKET = 600.0


def compile_allowance(args: ServerArgs) -> float:
    """Seconds the workers' compiled decode step may add to startup (0 when decode runs eagerly)."""
    if not args.compile_decode:
        return 0.0
    return COMPILE_SECONDS_PER_BUCKET * len(args.compile_buckets)


class EngineProcesses:
    def __init__(self, args: ServerArgs, startup_timeout: float = 120.0) -> None:
        self.args = args
        try:  # the tokenizer side needs both: the vocabulary bounds every id at the door
            if args.node_rank != 0:
                raise ValueError(f"node {args.node_rank} runs only its ranks (runtime.node_main.run_node), "
                                 "not an engine")
            self.config: ModelConfig = model_config(args)
            self.tokenizer: Tokenizer = tokenizer_for(args)
            self.chat_format: ChatFormat = chat_format_for(args, self.config, self.tokenizer, self.tokenizer.hf)
            self.sampling_defaults = sampling_defaults(args)
            self.ipc_dir = tempfile.mkdtemp(prefix="radixk3-")
            self.topology = Topology.for_args(args, self.ipc_dir)
        except Exception as e:
            if hasattr(self, "ipc_dir"):
                shutil.rmtree(self.ipc_dir, ignore_errors=True)
            raise EngineError(f"startup failed: {type(e).__name__}: {e}") from e
        self.num_replicas: int = self.topology.num_replicas
        self.dead: EngineError | None = None
        self._closed = False
        self._stopped = threading.Event()  # set once shutdown has stopped every process
        self._lock = threading.Lock()
        self._listeners: list[Callable[[EngineError], None]] = []
        self._ctx = zmq.Context()
        self._ready = self._ctx.socket(zmq.PULL)
        self._ready.setsockopt(zmq.LINGER, 0)
        self._ready.bind(self.endpoint("ready"))
        spawn = mp.get_context("spawn")
        topo = self.topology
        # This node's ranks first (the rank processes, replica by replica), then one scheduler per replica.
        self.ranks = topo.local_ranks(0)
        self.procs = [spawn.Process(target=worker_main, args=(args, topo, rid.replica, rid.rank), daemon=True,
                                    name=rank_process_name(rid)) for rid in self.ranks]
        self.procs += [spawn.Process(target=scheduler_main, args=(args, topo, i), daemon=True,
                                     name=f"radixk3-scheduler-{i}") for i in range(self.num_replicas)]
        self._control: list[zmq.Socket] = []  # Shutdown only; requests go through the tokenizer manager
        for i in range(self.num_replicas):
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self.endpoint(f"sched_in_{i}"))
            self._control.append(s)
        try:
            with main_module_hidden():
                for p in self.procs:
                    p.start()
            self._wait_ready(startup_timeout + compile_allowance(args))
        except BaseException:
            self.shutdown()
            raise
        self.watcher = threading.Thread(target=self._watch, daemon=True, name="radixk3-watcher")
        self.watcher.start()

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def endpoint(self, name: str) -> str:
        return self.topology.addr(name) if hasattr(self, "topology") else endpoint(self.ipc_dir, name)

    def worker(self, replica: int, rank: int) -> mp.process.BaseProcess:
        """The process of rank `rank` of replica `replica` (on this node)."""
        return self.procs[self.ranks.index(RankId(replica, rank))]

    # --- startup and watching --------------------------------------------------------------------------
    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        ready, want = 0, self.num_replicas * self.topology.tp_size  # every rank of every replica, on every node
        sizes: list[int] = []
        # One rank's compiled decode step, seconds per batch-size bucket (empty: eager), for the benchmarks.
        self.compile_seconds: dict[int, float] = {}
        while ready < want:
            if self._ready.poll(200):
                msg = decode(self._ready.recv_multipart())
                if isinstance(msg, WorkerReady | RankFailed):
                    if msg.error is not None:
                        raise EngineError(f"startup failed: {msg.error}")
                    ready += 1
                if isinstance(msg, WorkerReady) and msg.pool_bytes is not None:
                    sizes.append(msg.pool_bytes)
                    if msg.compile_buckets and not self.compile_seconds:
                        self.compile_seconds = dict(zip(msg.compile_buckets, msg.compile_seconds, strict=True))
            if (dead := self.dead_child()) is not None:
                if (why := self._last_word(1.0)) is not None:  # a failing child says why before it exits
                    raise EngineError(f"startup failed: {why}")
                raise EngineError(f"startup failed: {dead}")
            if time.monotonic() > deadline:
                raise EngineError(f"startup timed out after {timeout:.0f}s ({ready} of {want} ranks ready)")
        # A request must fit whichever replica it is routed to (each replica's scheduler checked its ranks agree).
        self.pool_bytes: int = min(sizes)

    def _last_word(self, wait_s: float) -> str | None:
        """The reason a child sent before it exited (a startup error or a rank failure), if one comes."""
        end = time.monotonic() + wait_s
        while self._ready.poll(max(0, int((end - time.monotonic()) * 1000))):
            msg = decode(self._ready.recv_multipart())
            if isinstance(msg, WorkerReady | RankFailed) and msg.error is not None:
                return msg.error
        return None

    def _rank_states(self) -> str:
        """Which of this node's ranks are stopped or gone: a hung rank is named even when a peer's timeout
        is what noticed it."""
        culprits, others = [], []  # stopped or killed ranks first: the others exited because of them
        for rid, p in zip(self.ranks, self.procs, strict=False):
            if is_stopped(p.pid):
                culprits.append(f"{rank_label(*rid)} (pid {p.pid}) is stopped")
            elif not p.is_alive():
                code = p.exitcode
                note = f"{rank_label(*rid)} exited with code {code}"
                if code == COLLECTIVE_FAILED_EXIT:
                    others.append(f"{note} (its collective failed)")
                else:
                    culprits.append(note + _signal_name(code))
        return "; ".join(culprits + others)

    def describe_scheduler(self, replica: int) -> str:
        """Replica `replica`'s scheduler as an error names it: its pid, and whether it is stopped."""
        p = self.procs[len(self.ranks) + replica]
        return f"the scheduler of replica {replica} (pid {p.pid}{', stopped' if is_stopped(p.pid) else ''})"

    def dead_child(self) -> str | None:
        for p in self.procs:
            if not p.is_alive():
                return f"process {p.name} exited with code {p.exitcode}"
        return None

    def _death(self, dead: str) -> EngineError:
        why = self._last_word(1.0)
        states = self._rank_states()
        parts = ([states] if states else []) + [why or dead]
        return EngineError(f"{'; '.join(parts)}; pending requests failed")

    def _watch(self) -> None:
        sentinels = [p.sentinel for p in self.procs]
        while not self._closed:
            if not multiprocessing.connection.wait(sentinels, timeout=0.5) or self._closed:
                continue
            dead = self.dead_child()
            if dead is None:
                continue
            err = self._death(dead)
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
            closing = self._closed
            self._closed = True
        if closing:  # another thread (the watcher, after a death) is stopping them: wait until it has
            if threading.current_thread() is not getattr(self, "watcher", None):
                self._stopped.wait(timeout=30)
            return
        with self._lock:
            for s in self._control:  # every replica's scheduler, which stops its ranks
                try:
                    s.send_multipart(encode(Shutdown()), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        grace = 1.0 if self.dead is not None else 5.0  # a dead sibling means nobody will answer
        end = time.monotonic() + grace
        for p in self.procs:
            if p.pid is None:
                continue  # never started
            p.join(timeout=max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.pid is not None and p.is_alive():
                p.terminate()
        for p in self.procs:
            if p.pid is None:
                continue
            p.join(timeout=3)
            if p.is_alive():  # a stopped (SIGSTOP) process ignores SIGTERM until continued
                p.kill()
                p.join(timeout=3)
        self._ctx.destroy(linger=0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        self._stopped.set()

    @property
    def closed(self) -> bool:
        return self._closed
