"""The scheduler's share of a decode step.

1. Scheduler alone: the real `Scheduler` (runtime/scheduler/scheduler.py) driven by a no-op worker that samples token 1
   for every sampled row, plans and results serialised as on the wire (`runtime.messages.encode`/`decode`),
   batch 1, 64, 256 of running decodes (k3-small layout; metadata only). Reported: the scheduler side's time
   per step (schedule + encode the plan + decode the result + process), steps/s, and plan bytes per step.
2. End to end: the k3-small decode step at batch 64 through `radixk3.Engine` (the multi-process engine, a
   random k3-small checkpoint written into a temp dir): 64 requests of 24-token prompts, greedy, EOS
   ignored; the step time is (t(short + K new tokens) - t(short)) / K, so prefill and start-up cancel out.
The scheduler's share of a decode step = (1) at batch 64 / (2).

Radix cache on/off and the comparison with transformers are in bench/offline_throughput.py.

    python bench/engine_throughput.py [--json] [--scheduler-only] [--steps N]

`--scheduler-only` runs only (1); it also runs on older trees (same Scheduler constructor), which is how
the "before" figure is measured: check the old commit out into a temp worktree and run this file there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# Run as a script, bench/ is sys.path[0] and bench/kernels.py would shadow the kernels package.
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.machine_info import cpu_name  # noqa: E402
from radixk3.config import preset  # noqa: E402
from runtime.messages import GenerateReq, StepPlan, StepResult, decode, encode  # noqa: E402
from runtime.pool_layout import PoolLayout  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402
from runtime.scheduler.scheduler import Scheduler  # noqa: E402
from runtime.server_args import ServerArgs  # noqa: E402

PRESET = "k3-small"


def git_head() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def noop_worker(frames: list[bytes]) -> list[bytes]:
    """The worker's side of the wire without a model: decode the plan, sample token 1 per sampled row."""
    plan: StepPlan = decode(frames)
    n = plan.num_sampled
    extra = len(plan.logits_index) - n
    return encode(StepResult(plan.step, [1] * n, [0.0] * n, [[] for _ in range(n)], [[] for _ in range(n)],
                             [0.0] * extra))


def scheduler_cost(batch: int, steps: int, prompt_len: int = 32, seed: int = 0) -> dict[str, float]:
    """Scheduler-side seconds per decode step with `batch` running requests (best of 3 rounds of `steps`)."""
    cfg = preset(PRESET)
    args = ServerArgs(mem_bytes=4 << 30, max_running_requests=batch, chunked_prefill_size=1 << 16)
    layout = PoolLayout.from_config(cfg, page_size=args.page_size)
    sched = Scheduler(args, layout, frozenset(), lambda ids: "")
    g = random.Random(seed)
    rounds = 3
    for i in range(batch):
        ids = [g.randrange(16, cfg.vocab_size) for _ in range(prompt_len)]
        params = SamplingParams.from_dict({"max_new_tokens": rounds * steps + 16, "temperature": 0, "ignore_eos": True},
                                          cfg.vocab_size)
        sched.add(GenerateReq(f"r{i}", ids, params))
    started: set[str] = set()
    while len(started) < batch:  # admit and prefill everyone: each has sampled its first token
        plan = sched.schedule()
        if plan is None:
            raise RuntimeError("the scheduler planned nothing while requests wait")
        for out in sched.process(decode(noop_worker(encode(plan)))):
            if out.error:
                raise RuntimeError(out.error)
            if out.token_ids:
                started.add(out.rid)
    best = float("inf")
    plan_bytes = 0
    for _ in range(rounds):
        side = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            plan = sched.schedule()
            frames = encode(plan)
            t1 = time.perf_counter()
            back = noop_worker(frames)  # the worker's time: not the scheduler's
            t2 = time.perf_counter()
            sched.process(decode(back))
            t3 = time.perf_counter()
            side += (t1 - t0) + (t3 - t2)
            plan_bytes = sum(len(f) for f in frames)
            if plan.num_sampled != batch:
                raise RuntimeError(f"a decode step sampled {plan.num_sampled} rows, not {batch}")
        best = min(best, side / steps)
    return {"seconds_per_step": best, "steps_per_s": 1 / best, "plan_bytes": plan_bytes}


def engine_decode_step(batch: int, short: int, extra: int, prompt_len: int = 24, dtype: str | None = None,
                       seed: int = 1) -> dict[str, float]:
    """Seconds per decode step at `batch` through radixk3.Engine on a random k3-small checkpoint."""
    import radixk3
    from radixk3.checkpoint import write_random_checkpoint

    cfg = preset(PRESET)
    g = random.Random(seed)

    def prompts() -> list[list[int]]:
        return [[g.randrange(16, cfg.vocab_size) for _ in range(prompt_len)] for _ in range(batch)]

    def params(n: int) -> dict[str, Any]:
        return {"max_new_tokens": n, "min_new_tokens": n, "temperature": 0, "ignore_eos": True}

    kw: dict[str, Any] = {"mem_bytes": 512 << 20, "max_running_requests": batch, "chunked_prefill_size": 4096}
    if dtype is not None:
        kw["dtype"] = dtype
    with tempfile.TemporaryDirectory(prefix="radixk3-bench-") as tmp:
        ckpt = write_random_checkpoint(cfg, Path(tmp) / PRESET, seed=0)
        with radixk3.Engine(model=str(ckpt), **kw) as engine:
            engine.generate(prompts(), params(4))  # first-call costs, at the batch's own shapes
            times: dict[int, tuple[float, int]] = {}
            for n in (short, short + extra, short, short + extra):  # best of two rounds each: noise only adds
                before = engine.get_metrics()["steps"]
                t0 = time.perf_counter()
                engine.generate(prompts(), params(n))
                t = (time.perf_counter() - t0, engine.get_metrics()["steps"] - before)
                times[n] = min(times.get(n, t), t)
    (t_s, steps_s), (t_l, steps_l) = times[short], times[short + extra]
    # Every request decodes exactly `extra` more tokens in the long round: `extra` more decode steps. (The step
    # counts from get_metrics are reported, not used: a metrics reply can lag behind the last step.)
    step = (t_l - t_s) / extra
    return {"seconds_per_step": step, "output_tok_s": batch / step, "steps_short": steps_s, "steps_long": steps_l,
            "seconds_short": t_s, "seconds_long": t_l}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="end with one JSON object of the figures")
    ap.add_argument("--scheduler-only", action="store_true", help="only the no-op-worker measurement")
    ap.add_argument("--steps", type=int, default=200, help="decode steps per timed round (scheduler alone)")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--engine-batch", type=int, default=64)
    ap.add_argument("--engine-new", type=int, default=64, help="K: extra decode steps timed through the engine")
    ap.add_argument("--dtype", default=None, help="engine --dtype (default: the checkpoint's, fp32)")
    a = ap.parse_args(argv)
    mach = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "commit": git_head()}
    print(f"machine: {mach['cpu']}, {mach['cores']} cores, {mach['torch_threads']} torch threads, torch "
          f"{mach['torch']}, python {mach['python']}; tree at {mach['commit']}")
    print(f"scheduler alone: {PRESET} layout, no-op worker, plans and results through the wire encoding")
    sched: dict[str, dict[str, float]] = {}
    for b in (int(x) for x in a.batches.split(",")):
        r = scheduler_cost(b, a.steps)
        sched[str(b)] = r
        print(f"  batch {b:4d}: {r['seconds_per_step'] * 1e6:9.1f} us/step  {r['steps_per_s']:9.1f} steps/s  "
              f"plan {r['plan_bytes']:7d} bytes", flush=True)
    summary: dict[str, Any] = {"machine": mach, "scheduler": sched}
    if not a.scheduler_only:
        e = engine_decode_step(a.engine_batch, 8, a.engine_new, dtype=a.dtype)
        summary["engine"] = {"batch": a.engine_batch} | e
        print(f"engine ({PRESET}, radixk3.Engine): decode step at batch {a.engine_batch}: "
              f"{e['seconds_per_step'] * 1e3:.1f} ms ({e['output_tok_s']:.1f} output tok/s)")
        key = str(a.engine_batch)
        if key not in sched:
            sched[key] = scheduler_cost(a.engine_batch, a.steps)
        share = sched[key]["seconds_per_step"] / e["seconds_per_step"]
        summary["scheduler_share"] = share
        print(f"scheduler's share of a decode step at batch {a.engine_batch}: {share:.2%} (target < 5%)")
    if a.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
