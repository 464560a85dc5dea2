"""Decode windows (`--num-scheduler-steps`) against a plan per step, in the real engine: one engine per value, all
alive at once (an idle engine's threads sleep), the same greedy requests sent to each in turn, round after round, so
that every phase of a shared machine meets them all; output tok/s per batch size, the median of the rounds, and its
ratio to the first value's. Every value's outputs must equal the first's. `--gsm8k` adds the race's gsm8k burst
(`bench/offline_throughput.py`'s: 32 requests at once behind a shared 5-shot prefix, 64 new tokens each), sent to
each engine in turn as well, from the second round on with its prompts cached.

    python bench/scheduler_steps.py [--model k3-small|k3-gsm8k|DIR] [--steps 1 4 8 16] [--batches 1 8 32]
        [--gsm8k] [--rounds 6] [--new-tokens 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import radixk3  # noqa: E402
from bench.machine_info import cpu_name  # noqa: E402
from bench.offline_throughput import decode_batch, gsm8k_burst, params, warm_prompts  # noqa: E402
from bench.openmp_spin import print_ratios  # noqa: E402
from radixk3.builtin_model import checkpoint_dir  # noqa: E402
from radixk3.tokenizer import checkpoint_tokenizer  # noqa: E402

PROMPT = 16


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="k3-small", help="a test preset (random weights, seed 0), k3-gsm8k (the "
                    "built-in model) or a checkpoint directory")
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 4, 8, 16],
                    help="--num-scheduler-steps values; the first is the baseline")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--gsm8k", action="store_true", help="also the race's gsm8k burst")
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
        burst = gsm8k_burst(checkpoint_tokenizer(checkpoint_dir(a.model)), 32, 800, 70, 64) if a.gsm8k else None
        names: list[int | str] = [*a.batches, *(["gsm8k"] if burst else [])]
        tok_s: dict[tuple[int, int | str], list[float]] = {(s, n): [] for s in a.steps for n in names}
        for r in range(a.rounds):
            for n in names:
                prompts = burst.prompts if isinstance(n, str) and burst else \
                    decode_batch(int(n), PROMPT, a.new_tokens, vocab, seed=1000 * r + int(n)).prompts
                new = burst.new_tokens if isinstance(n, str) and burst else a.new_tokens
                outs = {}
                for s, e in engines.items():
                    t0 = time.perf_counter()
                    res = e.generate(prompts, params(new))
                    tok_s[s, n].append(len(prompts) * new / (time.perf_counter() - t0))
                    outs[s] = [x["output_ids"] for x in res]
                if any(o != outs[a.steps[0]] for o in outs.values()):
                    raise SystemExit(f"{n}, round {r}: outputs differ across --num-scheduler-steps")
    finally:
        for e in engines.values():
            e.shutdown()
    base = a.steps[0]
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; {a.model}, {PROMPT}-token prompts, {a.new_tokens} new tokens, "
          f"median of {a.rounds} rounds, output tok/s (ratio to --num-scheduler-steps {base}); outputs equal")
    out: dict[str, object] = {"model": a.model, "rounds": a.rounds, "baseline_steps": base}
    out |= print_ratios(tok_s, a.steps, names)
    if a.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
