"""Past one device on CPU (gloo): throughput and prefix-cache hit rate of tp 1, tp 2, dp 2 (cache-aware and
round-robin dispatch) and tp 2 dp 2 DP attention (cache-aware) on the gsm8k burst, and the communication share
of a tp 2 step.

The burst: `--num-questions` gsm8k 5-shot prompts (bench/gsm8k's prompt builder: one shared few-shot prefix,
then a test question), all submitted at once to `radixk3.Engine`, greedy, `--max-new-tokens` each (EOS
ignored, so every configuration does the same work). Each configuration gets a fresh engine on the same
random checkpoint, warmed up and its cache flushed before the timed burst. Reported per configuration:
output tokens/s, latency, the cache hit rate (cached / prompt tokens from the requests' meta_info) and how
the prompts split over the replicas; ratios against tp 1 measured in the same run; whether every
configuration's greedy tokens equal tp 1's. The engine's worker ranks share the cores evenly
(`Topology.rank_threads`): tp 2 and dp 2 run two ranks of half the cores each.

Communication share: the same burst through the real scheduler and `ModelWorker` at tp 2, one process per
rank (each rank runs its own copy of the deterministic scheduler in process, as `LocalEngine`, so both send
the same plans to their worker), with every torch.distributed collective the model calls wrapped in a
timer: time inside collectives / time inside `ModelWorker.execute`, on rank 0, summed over the burst. A
collective's time includes waiting for the slower rank, as a worker-side measurement does. Each rank runs its
share of the cores in torch threads (`Topology.rank_threads`, as the engine's ranks do), so that the share
measures communication rather than two ranks oversubscribing the cores.

Every engine runs the whole burst in one batch unless `--max-running-requests` is below `--num-questions`. The
cache-aware router spreads the burst once the decode tokens the replica holding the prefix owes outweigh
computing the prefix again on the other (the prompt tokens per replica show the split).

    python bench/distributed.py [--json] [--preset k3-tiny] [--num-questions 64] [--max-new-tokens 32]
                                [--max-running-requests N]
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import platform
import queue
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parent.parent
# Run as a script, bench/ is sys.path[0] and bench/kernels.py would shadow the kernels package.
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.gsm8k import DATA, workload  # noqa: E402
from bench.machine_info import cpu_name  # noqa: E402

# name -> Engine keyword arguments
CONFIGS: dict[str, dict[str, Any]] = {
    "tp1": {},
    "tp2": {"tp_size": 2},
    "dp2_cache_aware": {"dp_size": 2, "load_balance_method": "cache_aware"},
    "dp2_round_robin": {"dp_size": 2, "load_balance_method": "round_robin"},
    "tp2_dp2_attention": {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True,
                          "load_balance_method": "cache_aware"},
}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all",
               "all_to_all_single", "broadcast", "reduce_scatter")


class Run(NamedTuple):
    tok_s: float
    latency: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    replica_prompt_tokens: list[int]  # how the prompts split over the replicas (one entry without DP)
    outputs: list[list[int]]

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def serve_burst(ckpt: Path, kw: dict[str, Any], prompts: list[list[int]], max_new: int,
                engine_kw: dict[str, Any]) -> Run:
    """One configuration: a fresh engine, warmed up (one request per replica), cache flushed, then the burst."""
    from runtime.tokenizer.engine import Engine

    with Engine(model=str(ckpt), **engine_kw, **kw) as eng:
        replicas = kw.get("dp_size", 1)
        # Unrelated warm-up prompts (first-call costs at every replica; the router sends distinct prompts apart).
        eng.generate([[17 + i] * (8 + i) for i in range(2 * replicas)], greedy(2))
        if not eng.flush_cache():
            raise RuntimeError("the cache could not be flushed after the warm-up")
        before = eng.get_metrics()
        t0 = time.perf_counter()
        outs = eng.generate(prompts, greedy(max_new))
        latency = time.perf_counter() - t0
        after = eng.get_metrics()
    meta = [o["meta_info"] for o in outs]
    key = "dp_ranks" if "dp_ranks" in after else "replicas"  # DP attention: per DP rank, inside one replica
    per, per_before = after.get(key, [after]), before.get(key, [before])
    split = [a["prompt_tokens"] - b["prompt_tokens"] for a, b in zip(per, per_before, strict=True)]
    out_tokens = sum(m["completion_tokens"] for m in meta)
    return Run(out_tokens / latency, latency, out_tokens, sum(m["prompt_tokens"] for m in meta),
               sum(m["cached_tokens"] for m in meta), split, [o["output_ids"] for o in outs])


# --- the communication share -------------------------------------------------------------------------------
def _timed(fn: Callable[..., Any], acc: list[float]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[0] += time.perf_counter() - t0
    return wrapper


class RankResult(NamedTuple):
    """What a rank sends back (as a plain tuple: run as a script, this class lives in `__main__`)."""

    rank: int
    comm_s: float
    step_s: float
    steps: int
    outputs: list[list[int]]
    threads: int  # torch threads the rank ran
    error: str | None


def _rank_main(rank: int, world: int, init: str, ckpt: str, engine_kw: dict[str, Any], prompts: list[list[int]],
               max_new: int, out: Any) -> None:  # noqa: ANN401
    import torch.distributed as dist

    from radixk3.parallel import destroy_parallel, exit_rank, init_parallel
    from runtime.local_engine import LocalEngine
    from runtime.server_args import ServerArgs
    from runtime.topology import Topology

    try:
        args = ServerArgs(model=ckpt, tp_size=world, **engine_kw)
        torch.set_num_threads(Topology.for_args(args, None).rank_threads(len(os.sched_getaffinity(0))))
        init_parallel(rank, world, init, timeout_s=120.0)
        comm = [0.0]
        for name in COLLECTIVES:  # the layers call these through the torch.distributed module at run time
            if hasattr(dist, name):
                setattr(dist, name, _timed(getattr(dist, name), comm))
        eng = LocalEngine(args)
        step = [0.0]
        eng.worker.execute = _timed(eng.worker.execute, step)  # type: ignore[method-assign]
        eng.generate([[17] * 8], greedy(2))  # first-call costs
        comm[0] = step[0] = 0.0
        steps_before = eng.scheduler.metrics.steps
        outs = eng.generate(prompts, greedy(max_new))
        out.put(tuple(RankResult(rank, comm[0], step[0], eng.scheduler.metrics.steps - steps_before, outs,
                                 torch.get_num_threads(), None)))
    except Exception as e:  # the parent reports it; never leave it waiting
        out.put(tuple(RankResult(rank, 0.0, 0.0, 0, [], 0, f"{type(e).__name__}: {e}")))
    finally:
        destroy_parallel()
    out.close()
    out.join_thread()  # the result is out before the process ends without finalization
    exit_rank(0)


class CommShare(NamedTuple):
    share: float
    comm_s: float
    step_s: float
    steps: int
    outputs: list[list[int]]
    rank_threads: int  # torch threads each rank ran


def comm_share(ckpt: Path, engine_kw: dict[str, Any], prompts: list[list[int]], max_new: int, world: int = 2,
               timeout_s: float = 600.0) -> CommShare:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    procs = [ctx.Process(target=_rank_main, args=(r, world, init, str(ckpt), engine_kw, prompts, max_new, out),
                         daemon=True, name=f"bench-rank-{r}") for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, RankResult] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world:
            try:
                item = RankResult(*out.get(timeout=1.0))
                got[item.rank] = item
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the tp {world} ranks did not finish in {timeout_s:.0f}s") from None
                if any(not p.is_alive() and p.exitcode not in (0, None) for p in procs):
                    raise RuntimeError("a rank exited without a result") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    errors = [f"rank {r}: {g.error}" for r, g in sorted(got.items()) if g.error]
    if errors:
        raise RuntimeError("; ".join(errors))
    if any(g.outputs != got[0].outputs for g in got.values()):
        raise RuntimeError("the ranks generated different tokens")
    r0 = got[0]
    return CommShare(r0.comm_s / r0.step_s if r0.step_s else 0.0, r0.comm_s, r0.step_s, r0.steps, r0.outputs,
                     r0.threads)


# --- main --------------------------------------------------------------------------------------------------
def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="end with one JSON object of the figures")
    ap.add_argument("--preset", default="k3-tiny", help="a random checkpoint of this preset (seed 0)")
    ap.add_argument("--num-questions", type=int, default=64)
    ap.add_argument("--num-shots", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--mem-mib", type=int, default=256, help="pool per rank, MiB")
    ap.add_argument("--max-running-requests", type=int, default=None,
                    help="each replica's (DP rank's) running batch; default: max(64, --num-questions)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of " + ", ".join(CONFIGS))
    ap.add_argument("--no-comm-share", action="store_true", help="skip the tp 2 communication measurement")
    a = ap.parse_args(argv)
    a.configs = a.configs.split(",")
    if unknown := set(a.configs) - set(CONFIGS):
        ap.error(f"unknown configurations: {sorted(unknown)}")
    if "tp1" not in a.configs:
        ap.error("tp1 is the baseline the ratios are measured against: keep it in --configs")
    if a.num_questions < 1 or a.max_new_tokens < 1 or a.num_shots < 0:
        ap.error("--num-questions and --max-new-tokens must be >= 1, --num-shots >= 0")
    if a.max_running_requests is None:
        a.max_running_requests = max(64, a.num_questions)
    elif a.max_running_requests < 1:
        ap.error("--max-running-requests must be >= 1")
    return a


def machine() -> dict[str, Any]:
    from bench.engine_throughput import git_head

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "backend": "gloo",
            "commit": git_head()}


def main(argv: Sequence[str] | None = None) -> int:
    a = parse(argv)
    from radixk3.checkpoint import write_random_checkpoint
    from radixk3.config import preset
    from radixk3.tokenizer import checkpoint_tokenizer

    t_start = time.perf_counter()
    mach = machine()
    print(f"machine: {mach['cpu']}, {mach['cores']} cores, {mach['torch_threads']} torch threads, torch "
          f"{mach['torch']}, python {mach['python']}, torch.distributed over gloo; tree at {mach['commit']}")
    w = workload(DATA / "test.jsonl", DATA / "train.jsonl", a.num_shots, a.num_questions)
    engine_kw = {"mem_bytes": a.mem_mib << 20, "max_running_requests": a.max_running_requests}
    runs: dict[str, Run] = {}
    with tempfile.TemporaryDirectory(prefix="radixk3-distributed-") as tmp:
        ckpt = write_random_checkpoint(preset(a.preset), Path(tmp) / a.preset, seed=0)
        tok = checkpoint_tokenizer(ckpt)
        prompts = [tok.encode(w.prefix + q, add_bos=True) for q in w.questions]
        print(f"workload: gsm8k burst, {len(prompts)} prompts at once ({a.num_shots}-shot prefix, "
              f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens), {a.max_new_tokens} new tokens each, "
              f"greedy, at most {a.max_running_requests} running per replica; random {a.preset} (seed 0)")
        for name in a.configs:
            t0 = time.perf_counter()
            r = runs[name] = serve_burst(ckpt, CONFIGS[name], prompts, a.max_new_tokens, engine_kw)
            print(f"{name:<16} {r.tok_s:9.1f} tok/s  latency {r.latency:7.2f} s  cache hit rate {r.hit_rate:.3f}  "
                  f"prompt tokens per replica {r.replica_prompt_tokens}  ({time.perf_counter() - t0:.0f} s with "
                  "startup)", flush=True)
        share: CommShare | None = None
        if not a.no_comm_share:
            share = comm_share(ckpt, engine_kw, prompts, a.max_new_tokens)
            print(f"tp 2 communication share of a step: {share.share:.1%} ({share.comm_s:.2f} s in collectives of "
                  f"{share.step_s:.2f} s in {share.steps} worker steps, rank 0; {share.rank_threads} torch threads "
                  "per rank)", flush=True)
    base = runs["tp1"]
    ratios = {f"{k}_vs_tp1": r.tok_s / base.tok_s for k, r in runs.items() if k != "tp1"}
    for k, v in ratios.items():
        print(f"tok/s {k}: {v:.2f}x")
    identical = {k: r.outputs == base.outputs for k, r in runs.items() if k != "tp1"}
    if share is not None:
        identical["tp2_local_ranks"] = share.outputs == base.outputs
    print("greedy tokens equal to tp1: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in identical.items()))
    took = time.perf_counter() - t_start
    print(f"took {took:.0f} s")
    if a.json:
        hit = {k: r.hit_rate for k, r in runs.items()}
        print(json.dumps({
            "hit_rate_dp1": hit["tp1"],
            "hit_rate_dp2_cache_aware": hit.get("dp2_cache_aware"),
            "hit_rate_dp2_round_robin": hit.get("dp2_round_robin"),
            "tok_s": {k: r.tok_s for k, r in runs.items()},
            "comm_share": None if share is None else share.share,
            "ratios_vs_tp1": ratios,
            "outputs_equal_tp1": identical,
            "runs": {k: {f: getattr(r, f) for f in Run._fields if f != "outputs"} | {"hit_rate": r.hit_rate}
                     for k, r in runs.items()},
            "comm": None if share is None else share._asdict() | {"outputs": None},
            "workload": {"num_questions": len(prompts), "num_shots": a.num_shots, "max_new_tokens": a.max_new_tokens,
                         "max_running_requests": a.max_running_requests, "prompt_tokens": base.prompt_tokens,
                         "preset": a.preset},
            "machine": mach,
            "seconds": took,
        }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
