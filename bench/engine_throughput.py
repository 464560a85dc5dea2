"""Engine throughput on k3-small: a shared-prefix workload with the radix cache on vs off (same run), and
the scheduler's own cost per step measured with a no-op worker (steps/s at batch 1, 64, 256).

Runs the real Scheduler and ModelWorker in one process (runtime.local_engine), so the figures are the
engine's work without ZeroMQ transport; the multi-process Engine adds one message round trip per step.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

import orjson
import torch

# Run as a script, bench/ is sys.path[0] and bench/kernels.py would shadow the kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixk3.config import preset  # noqa: E402
from radixk3.model import build_model  # noqa: E402
from runtime.local_engine import LocalEngine  # noqa: E402
from runtime.messages import StepPlan, StepResult  # noqa: E402
from runtime.server_args import ServerArgs  # noqa: E402


def shared_prefix_workload(n: int, shared: int, own: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = random.Random(seed)
    prefix = [g.randrange(vocab) for _ in range(shared)]
    return [prefix + [g.randrange(vocab) for _ in range(own)] for _ in range(n)]


def run_workload(model, prompts: list[list[int]], new_tokens: int, radix: bool) -> tuple[float, int, list]:  # noqa: ANN001
    args = ServerArgs(mem_bytes=256 << 20, disable_radix_cache=not radix, chunked_prefill_size=2048,
                      max_running_requests=64)
    eng = LocalEngine(args, model, wire=False)
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    # The first request warms the cache as a system prompt would; all then run concurrently.
    t0 = time.perf_counter()
    outs = eng.generate(prompts[:1], params)
    outs += eng.generate(prompts[1:], params)
    dt = time.perf_counter() - t0
    return sum(len(o) for o in outs) / dt, eng.scheduler.metrics.prefill_tokens_computed, outs


class NoopWorker:
    """Returns token 1 for every sampled row without running a model: isolates the scheduler's cost."""

    def execute(self, plan: StepPlan) -> StepResult:
        n = len(plan.sample_params)
        return StepResult(plan.step, [1] * n, [0.0] * n, [[] for _ in range(n)], [[] for _ in range(n)], [])


def scheduler_steps_per_s(batch: int, steps: int = 200) -> float:
    args = ServerArgs(mem_bytes=512 << 20, max_running_requests=batch, chunked_prefill_size=1 << 16)
    model = build_model(preset("k3-tiny"), seed=0)
    eng = LocalEngine(args, model, wire=True)
    eng.worker = NoopWorker()  # type: ignore[assignment]
    for i in range(batch):
        eng.submit([3 + i % 100] * 32, {"max_new_tokens": steps + 10, "ignore_eos": True, "temperature": 0})
    s = eng.scheduler
    s.process(eng.worker.execute(s.schedule()))  # admit and prefill everyone
    t0 = time.perf_counter()
    for _ in range(steps):
        plan = s.schedule()
        s.process(eng.worker.execute(plan))
    return steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--shared", type=int, default=400)
    ap.add_argument("--own", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=16)
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    machine = f"{platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"
    print(f"machine: {machine}")
    model = build_model(preset("k3-small"), seed=0)
    prompts = shared_prefix_workload(a.requests, a.shared, a.own, model.config.vocab_size)
    on_tps, on_prefill, on_out = run_workload(model, prompts, a.new_tokens, radix=True)
    off_tps, off_prefill, off_out = run_workload(model, prompts, a.new_tokens, radix=False)
    assert on_out == off_out, "radix cache changed greedy output"
    print(f"k3-small, {a.requests} requests of {a.shared} shared + {a.own} own tokens, {a.new_tokens} new each")
    print(f"  radix on : {on_tps:8.1f} output tok/s, {on_prefill} prefill tokens computed")
    print(f"  radix off: {off_tps:8.1f} output tok/s, {off_prefill} prefill tokens computed")
    print(f"  speedup {on_tps / off_tps:.2f}x, prefill tokens {off_prefill / max(on_prefill, 1):.2f}x fewer")
    sched = {b: scheduler_steps_per_s(b) for b in (1, 64, 256)}
    for b, v in sched.items():
        print(f"  scheduler alone (no-op worker), batch {b:3d}: {v:8.1f} steps/s")
    if a.json:
        print(orjson.dumps({
            "device": machine, "radix_on_tok_s": on_tps, "radix_off_tok_s": off_tps, "speedup": on_tps / off_tps,
            "prefill_tokens_on": on_prefill, "prefill_tokens_off": off_prefill,
            "sched_steps_per_s": {str(b): v for b, v in sched.items()},
        }).decode())


if __name__ == "__main__":
    main()
