"""Decode windows (`--num-scheduler-steps`) against a plan per step, in the real engine: one engine per value, all
alive at once (an idle engine's threads sleep), the same greedy requests sent to each in turn, round after round, so
that every phase of a shared machine meets them all; output tok/s per batch size, the median of the rounds, and its
ratio to the first value's. Every value's outputs must equal the first's.

    python bench/scheduler_steps.py [--model k3-small|k3-gsm8k|DIR] [--steps 1 4 8 16] [--batches 1 8 32]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import radixk3  # noqa: E402
from bench.machine_info import cpu_name  # noqa: E402
from bench.offline_throughput import decode_batch, params, warm_prompts  # noqa: E402

PROMPT = 16


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="k3-small", help="a test preset (random weights, seed 0), k3-gsm8k (the "
                    "built-in model) or a checkpoint directory")
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 4, 8, 16],
                    help="--num-scheduler-steps values; the first is the baseline")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    engines = {s: radixk3.Engine(model=a.model, dtype="float32", mem_bytes=512 << 20, max_running_requests=64,
                                 num_scheduler_steps=s) for s in a.steps}
    try:
        vocab = next(iter(engines.values())).procs.vocab_size
        for e in engines.values():
            e.generate(warm_prompts(vocab), params(4))
        tok_s: dict[tuple[int, int], list[float]] = {(s, n): [] for s in a.steps for n in a.batches}
        for r in range(a.rounds):
            for n in a.batches:
                prompts = decode_batch(n, PROMPT, a.new_tokens, vocab, seed=1000 * r + n).prompts
                outs = {}
                for s, e in engines.items():
                    t0 = time.perf_counter()
                    res = e.generate(prompts, params(a.new_tokens))
                    tok_s[s, n].append(n * a.new_tokens / (time.perf_counter() - t0))
                    outs[s] = [x["output_ids"] for x in res]
                if any(o != outs[a.steps[0]] for o in outs.values()):
                    raise SystemExit(f"batch {n}, round {r}: outputs differ across --num-scheduler-steps")
    finally:
        for e in engines.values():
            e.shutdown()
    base = a.steps[0]
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; {a.model}, {PROMPT}-token prompts, {a.new_tokens} new tokens, "
          f"median of {a.rounds} rounds, output tok/s (ratio to --num-scheduler-steps {base}); outputs equal")
    out: dict[str, object] = {"model": a.model, "rounds": a.rounds, "baseline_steps": base}
    for n in a.batches:
        med = {s: statistics.median(tok_s[s, n]) for s in a.steps}
        print(f"batch {n:3d}: " + "  ".join(f"{s}: {med[s]:8.1f} ({med[s] / med[base]:.2f}x)" for s in a.steps))
        out[f"b{n}"] = {str(s): {"tok_s": med[s], "ratio": med[s] / med[base]} for s in a.steps}
    if a.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
