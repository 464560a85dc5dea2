"""Requests read whole against requests streamed, in the real engine: the same greedy requests through
`Engine.generate`, which reads whole results (the scheduler sends a request's tokens every
`NON_STREAM_INTERVAL` and at the end), and through `Engine.generate(..., timeout=...)`, whose per-chunk timeout
keeps the requests streamed (a chunk a token), in turns, round after round; output tok/s per batch size, the median
of the rounds, and the ratio of whole to streamed. The two ways' outputs must be equal.

    python bench/whole_results.py [--model k3-small|k3-gsm8k|DIR] [--batches 1 8 32] [--rounds 8]
        [--new-tokens 64] [--json]
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
CHUNK_TIMEOUT_S = 3600.0  # never expires here: it only keeps the requests streamed


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="k3-small", help="a test preset (random weights, seed 0), k3-gsm8k (the "
                    "built-in model) or a checkpoint directory")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    ways = {"streamed": CHUNK_TIMEOUT_S, "whole": None}
    tok_s: dict[tuple[str, int], list[float]] = {(w, n): [] for w in ways for n in a.batches}
    with radixk3.Engine(model=a.model, dtype="float32", mem_bytes=512 << 20, max_running_requests=64) as engine:
        vocab = engine.procs.vocab_size
        engine.generate(warm_prompts(vocab), params(4))
        for r in range(a.rounds):
            for n in a.batches:
                prompts = decode_batch(n, PROMPT, a.new_tokens, vocab, seed=1000 * r + n).prompts
                # Cached first: both ways then start from the radix tree alike (a prompt's first pass prefills it
                # whole, a later one recomputes only its last token, in fp32 not always to the same greedy pick).
                engine.generate(prompts, params(1))
                outs = {}
                for way, timeout in ways.items():
                    t0 = time.perf_counter()
                    res = engine.generate(prompts, params(a.new_tokens), timeout=timeout)
                    outs[way] = [r["output_ids"] for r in res]
                    tok_s[way, n].append(n * a.new_tokens / (time.perf_counter() - t0))
                if outs["whole"] != outs["streamed"]:
                    raise SystemExit(f"batch {n}: whole and streamed outputs differ")
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; {a.model}, {PROMPT}-token prompts, {a.new_tokens} new tokens, "
          f"median of {a.rounds} rounds, output tok/s")
    out: dict[str, object] = {"model": a.model, "rounds": a.rounds}
    for n in a.batches:
        med = {w: statistics.median(tok_s[w, n]) for w in ways}
        ratio = med["whole"] / med["streamed"]
        print(f"batch {n:3d}: streamed {med['streamed']:8.1f}, whole {med['whole']:8.1f}: {ratio:.2f}x")
        out[f"b{n}"] = {"streamed_tok_s": med["streamed"], "whole_tok_s": med["whole"], "ratio": ratio}
    if a.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
