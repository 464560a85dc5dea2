"""The workers' OpenMP spin count against libgomp's default, in the real engine: one engine per GOMP_SPINCOUNT value,
all alive at once (an idle engine's threads sleep), the same greedy requests sent to each in turn, round after
round, so that every phase of a shared machine meets them all; output tok/s per batch size, the median of the
rounds, and its ratio to the first value's.

The worker sets `runtime.worker_main.OPENMP_SPIN_COUNT` unless the environment says how OpenMP waits; 300000 is
libgomp's own default (what a worker ran with before).

    python bench/openmp_spin.py [--model k3-small|k3-gsm8k|DIR] [--spin 300000 100000 20000] [--batches 1 8 32]
        [--rounds 6] [--new-tokens 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import radixk3  # noqa: E402
from bench.machine_info import cpu_name  # noqa: E402
from bench.offline_throughput import decode_batch, params, warm_prompts  # noqa: E402

LIBGOMP_DEFAULT = 300_000
PROMPT = 16


def print_ratios(tok_s: dict[tuple[Any, Any], list[float]], values: list[Any], rows: list[Any]) -> dict[str, object]:
    """Per row (a batch size, or a workload's name), each value's median tok/s over the rounds and its ratio to the
    first value's: printed a line a row, and returned keyed `b<batch>` (or the name) for the JSON."""
    base = values[0]
    out: dict[str, object] = {}
    for n in rows:
        med = {v: statistics.median(tok_s[v, n]) for v in values}
        label = n if isinstance(n, str) else f"batch {n:3d}"
        print(f"{label}: " + "  ".join(f"{v}: {med[v]:8.1f} ({med[v] / med[base]:.2f}x)" for v in values))
        out[n if isinstance(n, str) else f"b{n}"] = {str(v): {"tok_s": med[v], "ratio": med[v] / med[base]}
                                                      for v in values}
    return out


def start(model: str, spin: int) -> radixk3.Engine:
    """An engine whose worker processes start with GOMP_SPINCOUNT=spin (spawned children take the environment)."""
    os.environ["GOMP_SPINCOUNT"] = str(spin)
    try:
        return radixk3.Engine(model=model, dtype="float32", mem_bytes=512 << 20, max_running_requests=64)
    finally:
        del os.environ["GOMP_SPINCOUNT"]


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="k3-small", help="a test preset (random weights, seed 0), k3-gsm8k (the "
                    "built-in model) or a checkpoint directory")
    ap.add_argument("--spin", type=int, nargs="+", default=[LIBGOMP_DEFAULT, 100_000, 20_000],
                    help="GOMP_SPINCOUNT values; the first is the baseline")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if "OMP_WAIT_POLICY" in os.environ:
        raise SystemExit("OMP_WAIT_POLICY is set: it overrides the spin counts compared here; unset it")
    engines = {spin: start(a.model, spin) for spin in a.spin}
    try:
        vocab = next(iter(engines.values())).procs.vocab_size
        for e in engines.values():
            e.generate(warm_prompts(vocab), params(4))
        tok_s: dict[tuple[int, int], list[float]] = {(s, n): [] for s in a.spin for n in a.batches}
        for r in range(a.rounds):
            for n in a.batches:
                prompts = decode_batch(n, PROMPT, a.new_tokens, vocab, seed=1000 * r + n).prompts
                for spin, e in engines.items():
                    t0 = time.perf_counter()
                    e.generate(prompts, params(a.new_tokens))
                    tok_s[spin, n].append(n * a.new_tokens / (time.perf_counter() - t0))
    finally:
        for e in engines.values():
            e.shutdown()
    base = a.spin[0]
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; {a.model}, {PROMPT}-token prompts, {a.new_tokens} new tokens, "
          f"median of {a.rounds} rounds, output tok/s (ratio to GOMP_SPINCOUNT={base})")
    out: dict[str, object] = {"model": a.model, "rounds": a.rounds, "baseline_spin": base}
    out |= print_ratios(tok_s, a.spin, a.batches)
    if a.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
