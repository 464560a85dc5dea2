"""The scheduler process: its entry point, its loop, and its sockets to the tokenizer and to its ranks.

Per engine replica i (see `runtime.topology` for where the processes run and the addresses):
  tokenizer --PUSH/PULL--> scheduler i (`sched_in_{i}`), every scheduler --PUSH/PULL--> tokenizer (`sched_out`),
  scheduler i --PUSH/PULL--> its rank r (`worker_in_{i}_{r}`: the same plan to every rank),
  rank 0 --PUSH/PULL--> scheduler i (`worker_out_{i}`: the step's tokens; every rank's readiness or failure),
  every scheduler --PUSH/PULL--> the process supervisor (`ready`: readiness, why startup failed, or why a rank
  failed, so the request path `sched_out` belongs to the tokenizer manager alone, on whatever event loop it runs).
With DP attention (one replica): each attention group's ranks get that group's plan, and each group's first
rank sends its results (`runtime.scheduler.dp_attention`).

A rank whose collective fails (a peer died or hangs past `--dist-timeout`) reports it and exits, and a
scheduler that loses a rank's connection or hears of a failure reports it and exits: the engine fails as a
whole, never one step at a time on a broken group.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import time
from collections import deque

import zmq

from runtime.grammar import GrammarBackend
from runtime.messages import (
    AbortReq,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    MetricsOut,
    MetricsReq,
    RankFailed,
    Shutdown,
    StepPlan,
    StepResult,
    TokenOut,
    WorkerReady,
    decode,
    encode,
)
from runtime.model_files import model_config, tokenizer_for
from runtime.pool_layout import pool_layout
from runtime.scheduler.dp_attention import DPAttentionScheduler
from runtime.scheduler.scheduler import Scheduler
from runtime.scheduler.step_loop import StepLoop
from runtime.server_args import ServerArgs
from runtime.sockets import LINGER_MS, die_with_parent, disconnected, make_socket
from runtime.topology import Topology, rank_label

# How long an idle scheduler waits for more arrivals after the first before it plans (a TTFT cost paid only
# when the engine was idle).
ARRIVAL_WINDOW_MS = 5


class RankLost(Exception):
    """A rank of this replica failed or went away: the replica cannot run another step."""


class _Ranks:
    """One scheduler's sockets to its replica's ranks: the same plan to each (with DP attention, its group's),
    each group's first rank's result back, and a watch on every rank's connection."""

    def __init__(self, ctx: zmq.Context, topo: Topology, replica: int) -> None:
        self.replica = replica
        self.group_of = [topo.attention_group(r) for r in range(topo.tp_size)]
        self.pending: list[deque[StepResult]] = [deque() for _ in range(topo.attention_groups)]
        self.results = make_socket(ctx, zmq.PULL, topo.bind_addr(f"worker_out_{replica}"), bind=True)
        self.plans = [make_socket(ctx, zmq.PUSH, topo.bind_addr(f"worker_in_{replica}_{r}"), bind=True)
                      for r in range(topo.tp_size)]
        self.watches = [s.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED) for s in self.plans]
        self.poller = zmq.Poller()
        self.poller.register(self.results, zmq.POLLIN)
        for w in self.watches:
            self.poller.register(w, zmq.POLLIN)

    def wait_ready(self, relay: zmq.Socket) -> bool:
        """Relay every rank's readiness (or its failure) to the supervisor; False if one failed."""
        for _ in self.plans:
            ready = decode(self.results.recv_multipart())
            relay.send_multipart(encode(ready))
            if ready.error is not None:
                return False
        return True

    def check(self, events: dict[zmq.Socket, int]) -> None:
        for r, w in enumerate(self.watches):
            if w in events and disconnected(w):
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

    def recv(self) -> StepResult:
        return self.recv_groups()[0]

    def recv_groups(self) -> list[StepResult]:
        """The oldest step's result of every group, in group order (a group's results come in step order)."""
        while not all(self.pending):
            events = dict(self.poller.poll())
            self.check(events)
            if self.results in events:
                msg = decode(self.results.recv_multipart())
                if isinstance(msg, RankFailed):
                    raise RankLost(msg.error)
                if isinstance(msg, StepResult):
                    self.pending[msg.dp_rank].append(msg)
        return [q.popleft() for q in self.pending]

    def shutdown(self) -> None:
        for s in self.plans:
            try:
                s.send_multipart(encode(Shutdown()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # that rank is gone already
                pass


def scheduler_main(args: ServerArgs, topo: Topology, replica: int) -> None:
    assert topo.ipc_dir is not None  # schedulers run on node 0
    ipc_dir = topo.ipc_dir
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Terminated (the parent died or gave up waiting): remove the sockets' dir, which nobody else will.
    signal.signal(signal.SIGTERM, lambda *_: (shutil.rmtree(ipc_dir, ignore_errors=True), os._exit(1)))
    die_with_parent()
    ctx = zmq.Context()
    inbox = make_socket(ctx, zmq.PULL, topo.bind_addr(f"sched_in_{replica}"), bind=True)
    outbox = make_socket(ctx, zmq.PUSH, topo.addr("sched_out"), bind=False)
    ready_out = make_socket(ctx, zmq.PUSH, topo.addr("ready"), bind=False)
    ranks = _Ranks(ctx, topo, replica)
    try:
        cfg = model_config(args)
        tok = tokenizer_for(args)
        layout = pool_layout(cfg, args)
        stop_ids = frozenset(tok.stop_ids) | {cfg.eos_token_id}
        sched: Scheduler | DPAttentionScheduler
        if topo.attention_groups > 1:
            sched = DPAttentionScheduler(args, layout, stop_ids, tok.decode,
                                         lambda: GrammarBackend(tok, cfg.vocab_size, stop_ids))
        else:
            sched = Scheduler(args, layout, stop_ids, tok.decode, GrammarBackend(tok, cfg.vocab_size, stop_ids))
    except Exception as e:
        ready_out.send_multipart(encode(WorkerReady(-1, error=f"scheduler {replica}: {type(e).__name__}: {e}")))
        ctx.destroy(linger=LINGER_MS)
        return
    if not ranks.wait_ready(ready_out):
        return
    try:
        _serve(args, sched, ranks, inbox, outbox)
    except RankLost as e:  # the supervisor fails every pending request with this and stops the rest
        ready_out.send_multipart(encode(RankFailed(-1, str(e))))
        ctx.destroy(linger=LINGER_MS)
        os._exit(1)
    ranks.shutdown()
    ctx.destroy(linger=LINGER_MS)  # let the workers' Shutdown go out
    os._exit(0)


def _serve(args: ServerArgs, sched: Scheduler | DPAttentionScheduler, ranks: _Ranks, inbox: zmq.Socket,
           outbox: zmq.Socket) -> None:
    """The scheduler's loop, until Shutdown."""
    loop: StepLoop[StepPlan, StepResult] | StepLoop[list[StepPlan], list[StepResult]]
    if isinstance(sched, DPAttentionScheduler):
        loop = StepLoop(sched, ranks.send_groups, ranks.recv_groups, overlap=args.overlap_schedule)
    else:
        loop = StepLoop(sched, ranks.send, ranks.recv, overlap=args.overlap_schedule)
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    for w in ranks.watches:  # a rank lost while idle fails the engine now, not at the next request
        poller.register(w, zmq.POLLIN)
    while True:
        idle = not loop.busy
        timeout = None if idle else 0
        window_end: float | None = None
        while events := dict(poller.poll(timeout)):
            ranks.check(events)
            if inbox not in events:
                continue
            msg = decode(inbox.recv_multipart())
            if isinstance(msg, GenerateReq):
                try:
                    sched.add(msg)
                except Exception as e:  # a request the checks missed fails alone, never the scheduler
                    outbox.send_multipart(encode(TokenOut(msg.rid, [], finished="error",
                                                          error=f"{type(e).__name__}: {e}")))
            elif isinstance(msg, AbortReq):
                sched.abort(msg.rid)
            elif isinstance(msg, MetricsReq):
                metrics = dataclasses.asdict(sched.metrics_now())
                if isinstance(sched, DPAttentionScheduler):  # the sums above, and each DP rank's own counters
                    metrics["dp_ranks"] = [dataclasses.asdict(m) for m in sched.group_metrics()]
                outbox.send_multipart(encode(MetricsOut(metrics, msg.req_id)))
            elif isinstance(msg, FlushCacheReq):
                outbox.send_multipart(encode(FlushCacheOut(msg.req_id, sched.flush_cache())))
            elif isinstance(msg, Shutdown):
                return
            # Woken from idle: gather the rest of a burst (a batch's requests arrive a few hundred microseconds
            # apart) for up to ARRIVAL_WINDOW_MS before planning, so that they see each other and share their
            # prefix (in-batch sharing).
            if idle and window_end is None:
                window_end = time.monotonic() + ARRIVAL_WINDOW_MS / 1000
            timeout = max(0, int((window_end - time.monotonic()) * 1000)) if window_end is not None else 0
        for out in loop.step():
            outbox.send_multipart(encode(out))
