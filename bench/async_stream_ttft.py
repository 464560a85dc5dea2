"""Time to first token of concurrent `Engine.async_stream`s on k3-tiny (random weights).

N streams (default 100) start at once on one event loop, each a distinct short prompt, greedy, a few new
tokens; TTFT is from the moment all are started to each stream's first chunk holding a token. Prints the
median and the worst, and the wall time of the whole burst. Timings only: no test runs this.

    python bench/async_stream_ttft.py [--streams N] [--new-tokens K] [--rounds R] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/kernels.py must not shadow the kernels package

from radixk3.config import TINY_PRESET  # noqa: E402
from runtime.tokenizer.engine import Engine  # noqa: E402


async def burst(engine: Engine, streams: int, new_tokens: int) -> tuple[list[float], float]:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    ttft: list[float] = []

    async def one(i: int, start: float) -> None:
        first = True
        async for chunk in engine.async_stream([1, 100 + i, 200 + i, 300 + i], params):
            if first and chunk.token_ids:
                ttft.append(time.perf_counter() - start)
                first = False

    start = time.perf_counter()
    await asyncio.gather(*(one(i, start) for i in range(streams)))
    return ttft, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="bursts; the first warms up and is not reported")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with Engine(TINY_PRESET, mem_bytes=64 << 20, max_running_requests=max(a.streams, 1)) as engine:
        rows = [asyncio.run(burst(engine, a.streams, a.new_tokens)) for _ in range(a.rounds)]
    rounds = rows[1:] or rows
    ttft = [t for r, _ in rounds for t in r]
    out = {"streams": a.streams, "new_tokens": a.new_tokens, "rounds": len(rounds),
           "ttft_median_s": statistics.median(ttft), "ttft_worst_s": max(ttft),
           "burst_wall_s": statistics.median(w for _, w in rounds)}
    if a.json:
        print(json.dumps(out))
    else:
        print(f"{a.streams} concurrent async_streams, {a.new_tokens} new tokens each, {len(rounds)} rounds: "
              f"TTFT median {out['ttft_median_s'] * 1e3:.0f} ms, worst {out['ttft_worst_s'] * 1e3:.0f} ms; "
              f"burst wall {out['burst_wall_s']:.2f} s")


if __name__ == "__main__":
    main()
