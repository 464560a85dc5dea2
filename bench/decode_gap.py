"""Does one long prompt stall everyone else? A running stream's inter-token gaps and short requests' time to
first token while a long prompt prefills, through the real multi-process `radixk3.Engine`.

A stream decodes (greedy, EOS ignored); once it has produced `--before` tokens (their gaps give the median gap
before), a `--long-tokens` prompt arrives, and `--shorts` short requests arrive during its prefill, spread
over `--short-window` seconds. Reported: the stream's worst gap while the long prompt prefills (from its arrival
to its first token) against its median gap before, the long prompt's time to first token, each short
request's time to first token, and the prefill tokens per extend step in that window (from the scheduler's
counters). The stream is aborted once the long prompt has its first token. Timings only: no test runs this
but its smoke test.

With `--grammar-properties P` the disturbance is a slow grammar instead of a long prompt: a short request whose
`json_schema` has P optional integer properties (5,000 compiled for over a minute in the scheduler before
grammars were compiled in worker processes; 4,000 is about the most under the default --max-grammar-bytes),
under `--grammar-compile-timeout`; its "first token" is then its outcome, a token or a refusal (`grammar_refused`:
past the compile budget, or over the size limit). The warm-up sends a one-property schema first, so that the
compile workers (started at a server's first grammar, importing torch) are up before the window opens.

    python bench/decode_gap.py [--model k3-tiny|k3-small] [--long-tokens N] [--shorts K] [--json]
        [--chunked-prefill-size C] [--max-prefill-tokens B] [--disable-mixed-chunk]
        [--grammar-properties P [--grammar-compile-timeout S]]

`--disable-mixed-chunk` gives the old schedule (decodes wait for prefill work) on the same tree; on trees
from before fair prefill, run it without the scheduling flags to get the "before" figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # bench/kernels.py must not shadow the kernels package

import torch  # noqa: E402

from bench.machine_info import cpu_name  # noqa: E402
from radixk3.config import preset  # noqa: E402
from runtime.errors import InvalidRequest  # noqa: E402
from runtime.tokenizer.engine import Engine  # noqa: E402

FIRST_ID = 16  # random prompts draw ids above the tokenizer's special ones


def git_head() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


class FirstToken(NamedTuple):
    seconds: float  # from the request's arrival to its first token, or to its refusal
    refused: str | None = None  # why it was refused (a grammar past its compile budget)


async def first_token(engine: Engine, prompt: list[int], new: int, start: float,
                      extra: dict[str, Any] | None = None) -> FirstToken:
    """When the first chunk of `prompt`'s generation holding a token came, counted from `start` (or its
    refusal did)."""
    chunks = engine.async_stream(prompt, greedy(new) | (extra or {}))
    try:
        async for chunk in chunks:
            if chunk.token_ids or chunk.invalid:
                return FirstToken(time.perf_counter() - start, chunk.error if chunk.invalid else None)
    except InvalidRequest as e:  # refused at the door (a grammar over --max-grammar-bytes)
        return FirstToken(time.perf_counter() - start, e.message)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    raise RuntimeError("the request finished without a token")


def optional_properties_schema(n: int) -> str:
    return json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}})


async def run(engine: Engine, a: argparse.Namespace, vocab: int) -> dict[str, Any]:
    g = random.Random(a.seed)

    def prompt(n: int) -> list[int]:
        return [g.randrange(FIRST_ID, vocab) for _ in range(n)]

    await engine.async_generate(prompt(32), greedy(4))  # first-call costs out of the way
    if a.grammar_properties:  # and the compile workers' start (at the first grammar): the window holds the compile
        await engine.async_generate(prompt(8), greedy(1) | {"json_schema": optional_properties_schema(1)})
    arrivals: list[float] = []  # the stream's chunks holding tokens: arrival time, tokens
    long_sent = asyncio.Event()
    long_done = asyncio.Event()
    stream_ended = asyncio.Event()  # the stream reached --stream-max-tokens
    tokens_before = 0

    async def stream() -> None:
        nonlocal tokens_before
        async for chunk in engine.async_stream(prompt(16), greedy(a.stream_max_tokens)):
            if not chunk.token_ids:
                continue
            arrivals.append(time.perf_counter())
            if not long_sent.is_set():
                tokens_before += len(chunk.token_ids)
                if tokens_before >= a.before:
                    long_sent.set()
            if chunk.finished:
                stream_ended.set()
            if long_done.is_set() or chunk.finished:
                return

    stream_task = asyncio.create_task(stream())
    await long_sent.wait()
    m0 = await asyncio.to_thread(engine.get_metrics)
    t_long = time.perf_counter()
    if a.grammar_properties:
        schema = {"json_schema": optional_properties_schema(a.grammar_properties)}
        long_task = asyncio.create_task(first_token(engine, prompt(8), 1, t_long, schema))
    else:
        long_task = asyncio.create_task(first_token(engine, prompt(a.long_tokens), 1, t_long))
    shorts: list[tuple[float, asyncio.Task[FirstToken]]] = []
    for i in range(a.shorts):
        delay = a.short_window * (i + 1) / (a.shorts + 1)
        await asyncio.sleep(max(0.0, t_long + delay - time.perf_counter()))
        if long_task.done():
            break  # the long prompt is done: later shorts would not arrive during its prefill
        t = time.perf_counter()
        shorts.append((t - t_long, asyncio.create_task(first_token(engine, prompt(a.short_tokens), 2, t))))
    long_ttft, refused = await long_task
    t_first = t_long + long_ttft
    m1 = await asyncio.to_thread(engine.get_metrics)
    long_done.set()
    short_ttft = [(d, (await task).seconds) for d, task in shorts]
    stream_task.cancel()  # aborts the stream
    try:
        await stream_task
    except asyncio.CancelledError:
        pass
    gaps_before = [b - a_ for a_, b in zip(arrivals, arrivals[1:], strict=False) if b <= t_long]
    # Gaps that overlap the prefill window: from the last token before the long prompt arrived on.
    during = [t for t in arrivals if t >= t_long]
    last_before = max((t for t in arrivals if t < t_long), default=t_long)
    marks = [last_before] + [t for t in during if t <= t_first]
    if not stream_ended.is_set():  # its next token, after the window (an ended stream has none: no gap)
        marks.append(min((t for t in during if t > t_first), default=t_first))
    gaps_during = [b - a_ for a_, b in zip(marks, marks[1:], strict=False)]
    extend_steps = m1["extend_steps"] - m0["extend_steps"]
    prefill = m1["prefill_tokens_computed"] - m0["prefill_tokens_computed"]
    return {
        "stream_median_gap_before_s": statistics.median(gaps_before) if gaps_before else None,
        "stream_worst_gap_during_s": max(gaps_during) if gaps_during else None,
        "stream_tokens_during": sum(1 for t in during if t <= t_first),
        "stream_ended_during": stream_ended.is_set(),
        "long_ttft_s": long_ttft,
        "short_ttft_s": [{"arrived_after_s": d, "ttft_s": t} for d, t in short_ttft],
        "short_ttft_worst_s": max((t for _, t in short_ttft), default=None),
        "steps_during": m1["steps"] - m0["steps"],
        "extend_steps_during": extend_steps,
        "mixed_steps_during": m1.get("mixed_steps", 0) - m0.get("mixed_steps", 0),
        "prefill_tokens_per_extend_step": prefill / extend_steps if extend_steps else None,
        "grammar_refused": refused is not None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("k3-tiny", "k3-small"), default="k3-tiny",
                    help="k3-tiny (random weights), or a random k3-small checkpoint written to a temp dir")
    ap.add_argument("--long-tokens", type=int, default=20_000)
    ap.add_argument("--shorts", type=int, default=3, help="short requests arriving during the long prefill")
    ap.add_argument("--short-tokens", type=int, default=6)
    ap.add_argument("--short-window", type=float, default=3.0, help="seconds after the long prompt the shorts span")
    ap.add_argument("--before", type=int, default=32, help="stream tokens before the long prompt arrives")
    ap.add_argument("--stream-max-tokens", type=int, default=32768)
    ap.add_argument("--chunked-prefill-size", type=int, default=None)
    ap.add_argument("--max-prefill-tokens", type=int, default=None)
    ap.add_argument("--disable-mixed-chunk", action="store_true")
    ap.add_argument("--grammar-properties", type=int, default=0,
                    help="the disturbance is a json_schema of this many optional properties, not a long prompt")
    ap.add_argument("--grammar-compile-timeout", type=float, default=None)
    ap.add_argument("--mem-bytes", type=int, default=256 << 20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="end with one JSON object of the figures")
    a = ap.parse_args(argv)
    mach = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "commit": git_head()}
    print(f"machine: {mach['cpu']}, {mach['cores']} cores, {mach['torch_threads']} torch threads, torch "
          f"{mach['torch']}, python {mach['python']}; tree at {mach['commit']}")
    kw: dict[str, Any] = {"mem_bytes": a.mem_bytes}
    for name in ("chunked_prefill_size", "max_prefill_tokens", "grammar_compile_timeout"):
        if getattr(a, name) is not None:
            kw[name] = getattr(a, name)
    if a.disable_mixed_chunk:
        kw["enable_mixed_chunk"] = False
    name = a.model
    with tempfile.TemporaryDirectory(prefix="radixk3-bench-") as tmp:
        model = name  # the preset's random weights
        if a.model == "k3-small":
            from radixk3.checkpoint import write_random_checkpoint

            model = str(write_random_checkpoint(preset(name), Path(tmp) / name, seed=0))
        with Engine(model, **kw) as engine:
            args = engine.args
            fig = asyncio.run(run(engine, a, preset(name).vocab_size))
    settings = {"model": name, "long_tokens": a.long_tokens, "shorts": a.shorts,
                "grammar_properties": a.grammar_properties,
                "grammar_compile_timeout": getattr(args, "grammar_compile_timeout", None),
                "chunked_prefill_size": args.chunked_prefill_size,
                "max_prefill_tokens": getattr(args, "max_prefill_tokens", None),  # (absent on older trees)
                "enable_mixed_chunk": getattr(args, "enable_mixed_chunk", None)}
    summary = {"machine": mach, "settings": settings} | fig

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.0f} ms"

    what = (f"a {a.grammar_properties}-property json_schema (compile budget {settings['grammar_compile_timeout']} s)"
            if a.grammar_properties else f"a {a.long_tokens}-token prompt")
    print(f"{name}, {what} arriving during a stream; chunked_prefill_size "
          f"{settings['chunked_prefill_size']}, max_prefill_tokens {settings['max_prefill_tokens']}, mixed chunk "
          f"{settings['enable_mixed_chunk']}")
    print(f"  stream: median gap before {ms(fig['stream_median_gap_before_s'])}, worst gap during the prefill "
          f"{ms(fig['stream_worst_gap_during_s'])} ({fig['stream_tokens_during']} tokens during it)")
    outcome = "refused (compile budget)" if fig["grammar_refused"] else "first token"
    print(f"  {'grammar request' if a.grammar_properties else 'long prompt'}: {outcome} after "
          f"{ms(fig['long_ttft_s'])}, {fig['extend_steps_during']} extend steps "
          f"({fig['mixed_steps_during']} with decodes), {fig['prefill_tokens_per_extend_step'] or 0:.0f} prefill "
          "tokens per extend step")
    for s in fig["short_ttft_s"]:
        print(f"  short request arriving after {s['arrived_after_s']:.2f} s: first token after {ms(s['ttft_s'])}")
    if a.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
