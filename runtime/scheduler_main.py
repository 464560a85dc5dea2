"""The scheduler process: its entry point, its loop, and its sockets to the tokenizer and to its ranks.

Per engine replica i (see `runtime.topology` for where the processes run and the addresses):
  tokenizer --PUSH/PULL--> scheduler i (`sched_in_{i}`), every scheduler --PUSH/PULL--> tokenizer (`sched_out`: a
  step's outputs in one `TokenOuts`),
  scheduler i --PUSH/PULL--> its rank r (`worker_in_{i}_{r}`: the same plan to every rank),
  rank 0 --PUSH/PULL--> scheduler i (`worker_out_{i}`: the step's tokens; every rank's readiness or failure),
  every scheduler --PUSH/PULL--> the process supervisor (`ready`: readiness, why startup failed, or why a rank
  failed, so the request path `sched_out` belongs to the tokenizer manager alone, on whatever event loop it runs).
With DP attention (one replica): each attention group's ranks get that group's plan, and each group's first
rank sends its results (`runtime.scheduler.dp_attention`).

A rank whose collective fails (a peer died or hangs past `--dist-timeout`) reports it and exits, and a
scheduler that loses a rank's connection or hears of a failure reports it and exits: the engine fails as a
whole, never one step at a time on a broken group. A rank that is alive but stuck is the watchdog's
(`--watchdog-timeout`, `_Server`): its requests fail, and the engine serves again if it recovers.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import signal
import time
from collections import deque

import zmq

from runtime.disagg.protocol import RankAgent
from runtime.grammar import GrammarBackend
from runtime.messages import (
    AbortReq,
    ContinueReq,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    Heartbeat,
    MetricsOut,
    MetricsReq,
    PauseOut,
    PauseReq,
    RankFailed,
    Shutdown,
    StepPlan,
    StepResult,
    TokenOut,
    TokenOuts,
    WorkerReady,
    decode,
    encode,
)
from runtime.model_files import model_config, tokenizer_for
from runtime.model_files import stop_ids as model_stop_ids
from runtime.pool_layout import pool_layout
from runtime.process_info import is_stopped, scheduler_process_name, set_process_name
from runtime.scheduler.dp_attention import DPAttentionScheduler
from runtime.scheduler.scheduler import Scheduler
from runtime.scheduler.step_loop import StepLoop
from runtime.scheduler.watchdog import StepWatchdog
from runtime.server_args import ServerArgs
from runtime.sockets import LINGER_MS, die_with_parent, disconnected, make_socket
from runtime.topology import Topology, rank_label

# An idle scheduler woken by an arrival keeps gathering while more arrive, until ARRIVAL_GAP_MS pass without one
# (a TTFT cost paid only when the engine was idle) or ARRIVAL_CAP_MS after the first: a burst sent over longer than
# one gap (32 prompts from a busy client on 2 cores took over 5 ms) is still planned together.
ARRIVAL_GAP_MS = 5
ARRIVAL_CAP_MS = 50
# How long a rank's disconnect waits for the reason it may have sent before exiting (a collective's failure).
RANK_FAILED_GRACE_MS = 200
PEER_WAIT_MS = 1  # P/D: how long a scheduler with nothing to do but wait for the other side sleeps between looks


class RankLost(Exception):
    """A rank of this replica failed or went away: the replica cannot run another step."""


def agreed_pool_bytes(readies: list[WorkerReady], replica: int) -> int:
    """The pool size every rank of the replica allocated (they agree on it over their group): the scheduler
    lays out one pool's metadata for all of them, and a rank with another size would keep its states at other
    offsets (the pool is filled from both ends). A clear error naming each size if they differ."""
    size = readies[0].pool_bytes
    if size is None or any(r.pool_bytes != size for r in readies):
        each = ", ".join(f"rank {r.rank}: {r.pool_bytes} bytes" for r in sorted(readies, key=lambda r: r.rank))
        raise ValueError(f"the ranks of replica {replica} allocated pools of different sizes ({each}); "
                         "one scheduler cannot address them all")
    return size


class _Ranks:
    """One scheduler's sockets to its replica's ranks: the same plan to each (with DP attention, its group's),
    each group's first rank's result back, and a watch on every rank's connection."""

    def __init__(self, ctx: zmq.Context, topo: Topology, replica: int) -> None:
        self.replica = replica
        self.group_of = [topo.attention_group(r) for r in range(topo.tp_size)]
        self.local = [topo.node_of(r) == 0 for r in range(topo.tp_size)]  # on this node: /proc tells its state
        self.pids: list[int | None] = [None] * topo.tp_size
        self.pending: list[deque[StepResult]] = [deque() for _ in range(topo.attention_groups)]
        self.results = make_socket(ctx, zmq.PULL, topo.bind_addr(f"worker_out_{replica}"), bind=True)
        self.plans = [make_socket(ctx, zmq.PUSH, topo.bind_addr(f"worker_in_{replica}_{r}"), bind=True)
                      for r in range(topo.tp_size)]
        self.watches = [s.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED) for s in self.plans]

    def wait_ready(self) -> list[WorkerReady]:
        """Every rank's readiness, in the order they came; a failed rank's ends the list."""
        readies: list[WorkerReady] = []
        for _ in self.plans:
            readies.append(decode(self.results.recv_multipart()))
            if readies[-1].error is not None:
                break
            self.pids[readies[-1].rank] = readies[-1].pid
        return readies

    def check(self, events: dict[zmq.Socket, int]) -> None:
        for r, w in enumerate(self.watches):
            if w in events and disconnected(w):
                # A rank that failed said why before it exited (RankFailed, on the results socket), and the two
                # sockets' events come in either order: its reason first, when it comes within the grace.
                deadline = time.monotonic() + RANK_FAILED_GRACE_MS / 1000
                while (left := deadline - time.monotonic()) > 0 and self.results.poll(int(left * 1000) + 1):
                    self.read_results()  # raises RankLost with the reason if it came
                raise RankLost(f"{rank_label(self.replica, r)} went away (its process or node died)")

    def send(self, plan: StepPlan) -> None:
        frames = encode(plan)
        for s in self.plans:
            s.send_multipart(frames)

    def send_groups(self, plans: list[StepPlan]) -> None:
        """DP attention: each rank its attention group's plan."""
        frames = [encode(p) for p in plans]
        for s, g in zip(self.plans, self.group_of, strict=True):
            s.send_multipart(frames[g])

    def read_results(self) -> None:
        """Take every result that has come (a group's come in step order); a rank's failure raises RankLost."""
        while True:
            try:
                msg = decode(self.results.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if isinstance(msg, RankFailed):
                raise RankLost(msg.error)
            if isinstance(msg, StepResult):
                self.pending[msg.dp_rank].append(msg)

    @property
    def step_done(self) -> bool:
        """Whether every group's result of the oldest step outstanding has come."""
        return all(self.pending)

    def pop_step(self) -> list[StepResult]:
        """The oldest step's result of every group, in group order."""
        return [q.popleft() for q in self.pending]

    def describe_stuck(self, timeout_s: float) -> str:
        """The watchdog's error: the ranks whose result of the oldest step is missing, a stopped one named as
        such (with several ranks per group, any rank of the group may hold up its first rank's result)."""
        waiting = [r for r in range(len(self.plans)) if not self.pending[self.group_of[r]]]
        stopped = [r for r in waiting if self.local[r] and is_stopped(self.pids[r])]
        late = f"did not finish a step within {timeout_s:g} s (--watchdog-timeout)"
        if stopped:
            who = ", ".join(f"{rank_label(self.replica, r)} (pid {self.pids[r]})" for r in stopped)
            return f"watchdog: {who} {'is' if len(stopped) == 1 else 'are'} stopped and {late}"
        who = ", ".join(rank_label(self.replica, r) + (f" (pid {self.pids[r]})" if self.local[r] else "")
                        for r in waiting)
        return f"watchdog: {who} {late}"

    def shutdown(self) -> None:
        for s in self.plans:
            try:
                s.send_multipart(encode(Shutdown()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # that rank is gone already
                pass


class _ShutdownAsked(Exception):
    """Shutdown came (perhaps while the scheduler waited on a step): stop serving."""


class _Server:
    """The scheduler's loop: requests in, steps out to the ranks, results back, outputs out. While it waits on
    a step it keeps answering its inbox (aborts, metrics, new requests) and, with --watchdog-timeout, watches
    the step and sends the tokenizer side a heartbeat.

    A step that overruns the timeout fails every request of this scheduler with an error naming the ranks it
    waits on (`Scheduler.fail_all`: the memory of the requests in flight stays theirs until their steps come
    back, so a stuck rank that resumes writes nothing another request owns), and until every step outstanding
    has come back the scheduler is stuck: it refuses new requests, and its heartbeats say why (the tokenizer
    side's /health answers 503). The late results are then processed as usual (their tokens discarded), and
    the scheduler serves again."""

    def __init__(self, args: ServerArgs, sched: Scheduler | DPAttentionScheduler, ranks: _Ranks,
                 inbox: zmq.Socket, outbox: zmq.Socket) -> None:
        self.sched, self.ranks, self.inbox, self.outbox = sched, ranks, inbox, outbox
        self.watchdog = StepWatchdog(args.watchdog_timeout, args.heartbeat_interval)
        self.loop: StepLoop[StepPlan, StepResult] | StepLoop[list[StepPlan], list[StepResult]]
        if isinstance(sched, DPAttentionScheduler):
            self.loop = StepLoop(sched, self._send_groups, self._recv_groups, overlap=args.overlap_schedule)
        else:
            self.loop = StepLoop(sched, self._send, self._recv, overlap=args.overlap_schedule)
        self.poller = zmq.Poller()
        for s in (inbox, ranks.results, *ranks.watches):  # a rank lost while idle fails the engine now
            self.poller.register(s, zmq.POLLIN)

    def run(self) -> None:
        """Serve until Shutdown."""
        try:
            while True:
                self._gather()
                if outs := self.loop.step():
                    self._emit(TokenOuts(outs))
        except _ShutdownAsked:
            return

    def _gather(self) -> None:
        """Read what has come. Woken from idle, gather the rest of a burst (a batch's requests arrive a few
        hundred microseconds apart) until ARRIVAL_GAP_MS pass without an arrival (ARRIVAL_CAP_MS at most) before
        planning, so that they see each other and share their prefix (in-batch sharing)."""
        idle = not self.loop.busy
        # P/D: a scheduler with nothing to do but wait for the other side looks every PEER_WAIT_MS, not in a spin.
        peer_wait = isinstance(self.sched, Scheduler) and self.sched.waiting_on_peer
        timeout = None if idle else PEER_WAIT_MS if peer_wait else 0
        window_end: float | None = None
        cap: float | None = None
        while events := dict(self.poller.poll(timeout)):
            self._take(events)
            if self.inbox not in events:
                continue
            if idle:
                now = time.monotonic()
                cap = now + ARRIVAL_CAP_MS / 1000 if cap is None else cap
                window_end = min(cap, now + ARRIVAL_GAP_MS / 1000)
            timeout = max(0, int((window_end - time.monotonic()) * 1000)) if window_end is not None else 0
        if self.loop.busy:
            self._beat()

    def _take(self, events: dict[zmq.Socket, int]) -> None:
        self.ranks.check(events)
        if self.ranks.results in events:
            self.ranks.read_results()
        if self.inbox in events:
            while self.inbox.poll(0):
                self._handle(decode(self.inbox.recv_multipart()))

    def _handle(self, msg: object) -> None:
        sched = self.sched
        if isinstance(msg, GenerateReq):
            if self.watchdog.stuck is not None:  # it would wait behind the stuck step
                self._emit(TokenOut(msg.rid, [], finished="error", error=self.watchdog.stuck))
                return
            try:
                sched.add(msg)
            except Exception as e:  # a request the checks missed fails alone, never the scheduler
                self._emit(TokenOut(msg.rid, [], finished="error", error=f"{type(e).__name__}: {e}"))
        elif isinstance(msg, AbortReq):
            sched.abort(msg.rid)
        elif isinstance(msg, MetricsReq):
            metrics = dataclasses.asdict(sched.metrics_now())
            if isinstance(sched, DPAttentionScheduler):  # the sums above, and each DP rank's own counters
                metrics["dp_ranks"] = [dataclasses.asdict(m) for m in sched.group_metrics()]
            self._emit(MetricsOut(metrics, msg.req_id))
        elif isinstance(msg, FlushCacheReq):
            self._emit(FlushCacheOut(msg.req_id, sched.flush_cache()))
        elif isinstance(msg, PauseReq):
            sched.pause(msg.mode)
            self._emit(PauseOut(msg.req_id, sched.paused))
        elif isinstance(msg, ContinueReq):
            sched.resume()
            self._emit(PauseOut(msg.req_id, sched.paused))
        elif isinstance(msg, Shutdown):
            raise _ShutdownAsked

    # --- the step loop's ends --------------------------------------------------------------------------
    def _send(self, plan: StepPlan) -> None:
        self.ranks.send(plan)
        self.watchdog.sent(time.monotonic())

    def _send_groups(self, plans: list[StepPlan]) -> None:
        self.ranks.send_groups(plans)
        self.watchdog.sent(time.monotonic())

    def _recv(self) -> StepResult:
        return self._recv_groups()[0]

    def _recv_groups(self) -> list[StepResult]:
        """The oldest step's results; meanwhile the inbox is served and the step watched."""
        while not self.ranks.step_done:
            wait = self.watchdog.wait_s(time.monotonic())
            self._take(dict(self.poller.poll(None if wait is None else math.ceil(wait * 1000))))
            if self.ranks.step_done:
                break
            if self.watchdog.overdue(time.monotonic()) is not None:
                self._fire()
            self._beat()
        results = self.ranks.pop_step()
        if self.watchdog.came_back(time.monotonic()):  # the last step outstanding: healthy again
            self._heartbeat()
        return results

    # --- the watchdog ----------------------------------------------------------------------------------
    def _fire(self) -> None:
        self.watchdog.stuck = self.ranks.describe_stuck(self.watchdog.timeout_s)
        self._heartbeat()  # first, so that /health is 503 by the time the requests hear why
        if outs := self.sched.fail_all(self.watchdog.stuck):
            self._emit(TokenOuts(outs))

    def _beat(self) -> None:
        if self.watchdog.beat_due(time.monotonic()):
            self._heartbeat()

    def _heartbeat(self) -> None:
        if self.watchdog.enabled:
            self._emit(Heartbeat(self.ranks.replica, self.watchdog.stuck))
            self.watchdog.beaten(time.monotonic())

    def _emit(self, msg: object) -> None:
        self.outbox.send_multipart(encode(msg))


def scheduler_main(args: ServerArgs, topo: Topology, replica: int) -> None:
    assert topo.ipc_dir is not None  # schedulers run on node 0
    ipc_dir = topo.ipc_dir
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Terminated (the parent died or gave up waiting): remove the sockets' dir, which nobody else will.
    signal.signal(signal.SIGTERM, lambda *_: (shutil.rmtree(ipc_dir, ignore_errors=True), os._exit(1)))
    die_with_parent()
    set_process_name(scheduler_process_name(replica))
    ctx = zmq.Context()
    inbox = make_socket(ctx, zmq.PULL, topo.bind_addr(f"sched_in_{replica}"), bind=True)
    outbox = make_socket(ctx, zmq.PUSH, topo.addr("sched_out"), bind=False)
    ready_out = make_socket(ctx, zmq.PUSH, topo.addr("ready"), bind=False)
    ranks = _Ranks(ctx, topo, replica)
    sched: Scheduler | DPAttentionScheduler
    try:
        cfg = model_config(args)
        tok = tokenizer_for(args)
        layout = pool_layout(cfg, args)
        stop_ids = model_stop_ids(args, tok, cfg)
        # The ranks size the pool (after loading their weights) and say how big it is when they are ready.
        readies = ranks.wait_ready()
        if readies[-1].error is not None:
            ready_out.send_multipart(encode(readies[-1]))
            ctx.destroy(linger=LINGER_MS)
            return
        pool_bytes = agreed_pool_bytes(readies, replica)
        grammar = GrammarBackend(tok, cfg.vocab_size, stop_ids, args)  # one compile pool for the process
        if topo.attention_groups > 1:
            sched = DPAttentionScheduler(args, layout, stop_ids, tok.decode, lambda: grammar, pool_bytes=pool_bytes)
        else:
            agents = [RankAgent(**r.transfer) for r in sorted(readies, key=lambda r: r.rank) if r.transfer is not None]
            sched = Scheduler(args, layout, stop_ids, tok.decode, grammar, pool_bytes=pool_bytes,
                              transfer_agents=agents or None)
    except Exception as e:
        ready_out.send_multipart(encode(WorkerReady(-1, error=f"scheduler {replica}: {type(e).__name__}: {e}")))
        ctx.destroy(linger=LINGER_MS)
        return
    for ready in readies:  # only now: the supervisor takes the engine as started once every rank is ready
        ready_out.send_multipart(encode(ready))
    try:
        _Server(args, sched, ranks, inbox, outbox).run()
    except RankLost as e:  # the supervisor fails every pending request with this and stops the rest
        ready_out.send_multipart(encode(RankFailed(-1, str(e))))
        ctx.destroy(linger=LINGER_MS)
        os._exit(1)
    ranks.shutdown()
    ctx.destroy(linger=LINGER_MS)  # let the workers' Shutdown go out
    os._exit(0)
