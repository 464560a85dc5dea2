"""A worker rank's process: load its shard of the model, then run the plans its scheduler sends, each rank of
the replica (or of its DP attention group) the same plan, until Shutdown. A rank whose collective fails (a
peer died or hangs past `--dist-timeout`) reports it and exits: the engine fails as a whole."""

from __future__ import annotations

import dataclasses
import os
import signal

import zmq

from runtime.messages import RankFailed, Shutdown, WorkerReady, decode, encode
from runtime.process_info import set_process_name, worker_process_name
from runtime.server_args import ServerArgs
from runtime.sockets import LINGER_MS, die_with_parent, disconnected, make_socket
from runtime.topology import COLLECTIVE_FAILED_EXIT, Topology, rank_label

# Rounds a worker's idle OpenMP threads spin for the next parallel region before they sleep (libgomp's default
# is 300,000). The scheduler and tokenizer processes share the worker's cores: while a thread spins through a
# stretch of serial Python, one of them takes a core from the worker, often from the thread the step waits on.
# Sleeping sooner leaves them an idle core instead: k3-small on 2 cores, 1.04-1.05x the output tok/s at batch 1,
# 1.02-1.06x at 8, 1.05x at 32 (`bench/openmp_spin.py`). The user's GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
OPENMP_SPIN_COUNT = 100_000


def openmp_waits() -> None:
    """Set the worker's OpenMP spin count in its environment, unless the user set how OpenMP waits. libgomp
    reads it once, when torch loads it, so this runs before the worker imports torch."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(OPENMP_SPIN_COUNT)


def worker_main(args: ServerArgs, topo: Topology, replica: int, rank: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and tells us to stop
    die_with_parent()
    set_process_name(worker_process_name(replica, rank))
    who = rank_label(replica, rank)
    ctx = zmq.Context()
    plans = make_socket(ctx, zmq.PULL, topo.addr(f"worker_in_{replica}_{rank}"), bind=False)
    # The scheduler's end of the plan socket closing means the scheduler (or its node) is gone: stop.
    scheduler_watch = plans.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    results = make_socket(ctx, zmq.PUSH, topo.addr(f"worker_out_{replica}"), bind=False)
    openmp_waits()
    try:
        import torch

        from radixk3.parallel import exit_rank, init_parallel
        from runtime.worker.model_worker import ModelWorker  # the model only in the worker: never in the scheduler

        torch.set_num_threads(topo.rank_threads(len(os.sched_getaffinity(0))))
        args = dataclasses.replace(args, device=topo.rank_device(args.device, replica, rank))
        init_parallel(rank, topo.tp_size, topo.dist_init(replica), args.ep_size, timeout_s=args.dist_timeout,
                      dp_size=topo.attention_groups, device=args.device)
        worker = ModelWorker(args)
    except Exception as e:  # report why we could not start, then exit
        results.send_multipart(encode(WorkerReady(rank, error=f"{who}: {type(e).__name__}: {e}")))
        ctx.destroy(linger=LINGER_MS)
        return
    built = worker.compile_seconds
    agent = dataclasses.asdict(worker.transfer.describe()) if worker.transfer is not None else None
    results.send_multipart(encode(WorkerReady(rank, pool_bytes=worker.pool_bytes, pid=os.getpid(),
                                              compile_buckets=list(built), compile_seconds=list(built.values()),
                                              transfer=agent)))
    poller = zmq.Poller()
    poller.register(plans, zmq.POLLIN)
    poller.register(scheduler_watch, zmq.POLLIN)
    scheduler_gone = False
    while True:
        events = dict(poller.poll())
        if scheduler_watch in events:
            scheduler_gone |= disconnected(scheduler_watch)
        if plans not in events:  # plans first: a Shutdown may be waiting behind the scheduler's exit
            if scheduler_gone and not plans.poll(0):
                os._exit(1)  # nobody left to serve; the group may be broken, so no orderly teardown
            continue
        msg = decode(plans.recv_multipart())
        if isinstance(msg, Shutdown):
            break
        try:  # a failed step comes back as a failed StepResult; what escapes is a broken TP group
            res = worker.execute(msg)
        except Exception as e:  # fatal for this rank, and so for the engine
            why = f"{who}: collective failed (a peer rank died or hangs): {type(e).__name__}: {e}"
            results.send_multipart(encode(RankFailed(rank, why)))
            ctx.destroy(linger=LINGER_MS)
            os._exit(COLLECTIVE_FAILED_EXIT)
        if topo.leads_group(rank):  # every rank of a group computes the same tokens; its first rank's count
            res.dp_rank = topo.attention_group(rank)
            results.send_multipart(encode(res))
    ctx.destroy(linger=0)
    exit_rank(0)
