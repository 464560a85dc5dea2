"""The scheduler and worker process entry points, and the ZeroMQ plumbing between them.

Sockets are `ipc://` files in a per-instance temp dir:
  tokenizer --PUSH/PULL--> scheduler (`sched_in`), scheduler --PUSH/PULL--> tokenizer (`sched_out`),
  scheduler --PUSH/PULL--> worker (`worker_in`), worker --PUSH/PULL--> scheduler (`worker_out`),
  scheduler --PUSH/PULL--> the process supervisor (`ready`: startup readiness or why startup failed, so the
  request path `sched_out` belongs to the tokenizer manager alone, on whatever event loop it runs).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import shutil
import signal
import time
import traceback
from pathlib import Path

import zmq

from radixk3.config import BUILTIN_PRESET, ModelConfig, preset
from radixk3.tokenizer import Tokenizer, load_tokenizer
from runtime.grammar import GrammarBackend
from runtime.messages import (
    AbortReq,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    MetricsOut,
    MetricsReq,
    Shutdown,
    StepPlan,
    StepResult,
    TokenOut,
    WorkerReady,
    decode,
    encode,
)
from runtime.pool_layout import pool_layout
from runtime.scheduler import Scheduler
from runtime.server_args import ServerArgs
from runtime.step_loop import StepLoop

# How long an idle scheduler waits for more arrivals after the first before it plans (a TTFT cost paid only
# when the engine was idle).
ARRIVAL_WINDOW_MS = 5


def endpoint(ipc_dir: str, name: str) -> str:
    return f"ipc://{Path(ipc_dir) / name}"


def model_config(args: ServerArgs) -> ModelConfig:
    return preset(BUILTIN_PRESET) if args.model is None else ModelConfig.from_file(args.model)


def tokenizer_for(args: ServerArgs) -> Tokenizer:
    if args.model is not None and (Path(args.model) / "tokenizer.model").is_file():
        return load_tokenizer(Path(args.model) / "tokenizer.model")
    return load_tokenizer()


def _socket(ctx: zmq.Context, kind: int, addr: str, bind: bool) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 2000)  # a failing process's last word (why it failed) must still be delivered
    (s.bind if bind else s.connect)(addr)
    return s


def _die_with_parent() -> None:
    """Children get SIGTERM when the tokenizer process dies, however it dies (Linux prctl PDEATHSIG)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def worker_main(args: ServerArgs, ipc_dir: str, rank: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and tells us to stop
    _die_with_parent()
    ctx = zmq.Context()
    plans = _socket(ctx, zmq.PULL, endpoint(ipc_dir, f"worker_in_{rank}"), bind=True)
    results = _socket(ctx, zmq.PUSH, endpoint(ipc_dir, "worker_out"), bind=False)
    try:
        from runtime.model_worker import ModelWorker  # the model only in the worker: never in the scheduler

        worker = ModelWorker(args)
    except Exception as e:  # report why we could not start, then exit
        results.send_multipart(encode(WorkerReady(rank, error=f"{type(e).__name__}: {e}")))
        ctx.destroy(linger=2000)
        return
    results.send_multipart(encode(WorkerReady(rank)))
    while True:
        msg = decode(plans.recv_multipart())
        if isinstance(msg, Shutdown):
            break
        try:
            results.send_multipart(encode(worker.execute(msg)))
        except Exception:
            results.send_multipart(encode(StepResult(msg.step, [], [], [], [], [], error=traceback.format_exc())))
    ctx.destroy(linger=0)


def scheduler_main(args: ServerArgs, ipc_dir: str, num_workers: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Terminated (the parent died or gave up waiting): remove the sockets' dir, which nobody else will.
    signal.signal(signal.SIGTERM, lambda *_: (shutil.rmtree(ipc_dir, ignore_errors=True), os._exit(1)))
    _die_with_parent()
    ctx = zmq.Context()
    inbox = _socket(ctx, zmq.PULL, endpoint(ipc_dir, "sched_in"), bind=True)
    outbox = _socket(ctx, zmq.PUSH, endpoint(ipc_dir, "sched_out"), bind=False)
    ready_out = _socket(ctx, zmq.PUSH, endpoint(ipc_dir, "ready"), bind=False)
    from_workers = _socket(ctx, zmq.PULL, endpoint(ipc_dir, "worker_out"), bind=True)
    to_workers = [_socket(ctx, zmq.PUSH, endpoint(ipc_dir, f"worker_in_{r}"), bind=False) for r in range(num_workers)]
    try:
        cfg = model_config(args)
        tok = tokenizer_for(args)
        layout = pool_layout(cfg, args)
        stop_ids = frozenset(tok.stop_ids) | {cfg.eos_token_id}
        sched = Scheduler(args, layout, stop_ids, tok.decode, cfg.vocab_size,
                          GrammarBackend(tok, cfg.vocab_size, stop_ids))
    except Exception as e:
        ready_out.send_multipart(encode(WorkerReady(-1, error=f"scheduler: {type(e).__name__}: {e}")))
        ctx.destroy(linger=2000)
        return
    for _ in range(num_workers):  # relay every worker's readiness (or its failure) to the tokenizer side
        ready = decode(from_workers.recv_multipart())
        ready_out.send_multipart(encode(ready))
        if ready.error is not None:
            return

    def send(plan: StepPlan) -> None:
        frames = encode(plan)
        for s in to_workers:
            s.send_multipart(frames)

    def recv() -> StepResult:
        results = [decode(from_workers.recv_multipart()) for _ in to_workers]
        return results[0]

    loop = StepLoop(sched, send, recv, overlap=args.overlap_schedule)
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    running = True
    while running:
        idle = not loop.busy
        timeout = None if idle else 0
        window_end: float | None = None
        while poller.poll(timeout):
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
                outbox.send_multipart(encode(MetricsOut(dataclasses.asdict(sched.metrics_now()), msg.req_id)))
            elif isinstance(msg, FlushCacheReq):
                outbox.send_multipart(encode(FlushCacheOut(msg.req_id, sched.flush_cache())))
            elif isinstance(msg, Shutdown):
                running = False
                break
            # Woken from idle: gather the rest of a burst (a batch's requests arrive a few hundred microseconds
            # apart) for up to ARRIVAL_WINDOW_MS before planning, so that they see each other and share their
            # prefix (in-batch sharing).
            if idle and window_end is None:
                window_end = time.monotonic() + ARRIVAL_WINDOW_MS / 1000
            timeout = max(0, int((window_end - time.monotonic()) * 1000)) if window_end is not None else 0
        if not running:
            break
        for out in loop.step():
            outbox.send_multipart(encode(out))
    for s in to_workers:
        s.send_multipart(encode(Shutdown()))
    ctx.destroy(linger=2000)  # let the workers' Shutdown go out
    os._exit(0)
