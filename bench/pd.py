"""Aggregated serving vs prefill/decode disaggregation on this machine: one radixk3 server driven directly, then one
prefill and one decode radixk3 server (NIXL over loopback, UCX_TLS=tcp) behind the real `sglang-router
--pd-disaggregation`, the same model and the same workload for both.

The workload mixes the two phases: `--shorts` short prompts that decode `--short-new-tokens` tokens each start
at once, and while they decode, `--longs` long prompts (`--long-tokens` each, a few new tokens) arrive one every
`--long-interval` seconds. Every request streams (/generate, greedy, EOS ignored). Reported for each mode: time to
first token (mean / p50 / p90, all requests, and the long prompts' and the short ones' apart), the short decodes'
inter-token gaps (p50 / p90: what a long prefill does to running decodes), and output tokens per second over the
whole run (all completion tokens / first send to last token). For P/D, from the prefill server's own counters
(`pd_*` in /get_server_info's scheduler metrics): the bytes moved per request, KDA state and MLA KV apart, against
the plan (what the pool geometry says a request moves: one state block + its prompt's pages x page bytes), the
transfers per request (a long prompt goes chunk by chunk), and the transfer time per MB of the writes the prefill
workers time (each request's last write: its remaining pages and its state block).

On one machine the prefill and decode servers split its cores, half each (the aggregated server has them all), so
P/D here shows the protocol's cost and what separating prefill from decode does to the latencies, not the
scale-out of two machines. Timings only: no test runs this.

    UCX_TLS=tcp python bench/pd.py [--model k3-tiny|k3-small] [--quick] [--json] [--server-flag=--FLAG ...]

`--quick`: k3-tiny (random weights) and a small workload (a smoke run, a minute or so); the default is k3-small
(a random checkpoint written to a temp dir).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script, bench/ is sys.path[0] and bench/kernels.py shadows kernels

from bench.machine_info import cpu_name  # noqa: E402
from bench.router_hit_rate import free_port, stop_process  # noqa: E402

START_S = 240.0  # a server's start (k3-small on a busy 2-core machine), or the router's first routed request
FIRST_ID = 16  # prompts draw ids above the tokenizer's special ones


# --- the workload ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    kind: str  # "long" or "short"
    delay_s: float  # after the run's start
    input_ids: list[int]
    new_tokens: int


def workload(a: argparse.Namespace, vocab: int) -> list[Job]:
    g = random.Random(a.seed)

    def ids(n: int) -> list[int]:
        return [g.randrange(FIRST_ID, vocab) for _ in range(n)]

    shorts = [Job("short", 0.0, ids(a.short_tokens), a.short_new_tokens) for _ in range(a.shorts)]
    longs = [Job("long", a.long_interval * (i + 1), ids(a.long_tokens), a.long_new_tokens) for i in range(a.longs)]
    return shorts + longs


@dataclass
class Timing:
    kind: str
    prompt_tokens: int
    sent: float
    token_times: list[float]  # when each streamed token came (an event's tokens share its time)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent


async def run_job(client: httpx.AsyncClient, url: str, job: Job, t0: float) -> Timing:
    await asyncio.sleep(max(0.0, t0 + job.delay_s - time.perf_counter()))
    body = {"input_ids": job.input_ids, "stream": True,
            "sampling_params": {"max_new_tokens": job.new_tokens, "temperature": 0, "ignore_eos": True}}
    t = Timing(job.kind, len(job.input_ids), time.perf_counter(), [])
    async with client.stream("POST", f"{url}/generate", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}/generate answered {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                continue
            event = orjson.loads(data)
            if "error" in event or event.get("meta_info", {}).get("error"):
                raise RuntimeError(f"request failed: {data[:500]}")
            n = event["meta_info"]["completion_tokens"]
            now = time.perf_counter()
            t.token_times.extend([now] * (n - len(t.token_times)))
    if len(t.token_times) != job.new_tokens:
        raise RuntimeError(f"a {job.kind} request streamed {len(t.token_times)} of {job.new_tokens} tokens")
    return t


async def run_workload(url: str, jobs: list[Job]) -> tuple[list[Timing], float]:
    """Every job through `url`; the timings and the wall time from the first send to the last token."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        t0 = time.perf_counter()
        timings = await asyncio.gather(*(run_job(client, url, j, t0) for j in jobs))
    return list(timings), max(t.token_times[-1] for t in timings) - t0


# --- figures -----------------------------------------------------------------------------------------------
def pct(xs: Sequence[float], q: float) -> float:
    """The q-quantile, linearly interpolated (statistics.quantiles' 'inclusive' method)."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    i = q * (len(s) - 1)
    lo = int(i)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (i - lo)


@dataclass
class Latencies:
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    long_ttft_p50_s: float
    short_ttft_p50_s: float
    short_gap_p50_s: float
    short_gap_p90_s: float
    output_tokens: int
    wall_s: float

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s


def latencies(timings: list[Timing], wall_s: float) -> Latencies:
    ttft = [t.ttft for t in timings]
    gaps = [b - a for t in timings if t.kind == "short" for a, b in itertools.pairwise(t.token_times)]
    long = [t.ttft for t in timings if t.kind == "long"] or [float("nan")]
    short = [t.ttft for t in timings if t.kind == "short"] or [float("nan")]
    gaps = gaps or [float("nan")]
    return Latencies(statistics.fmean(ttft), pct(ttft, 0.5), pct(ttft, 0.9), pct(long, 0.5), pct(short, 0.5),
                     pct(gaps, 0.5), pct(gaps, 0.9), sum(len(t.token_times) for t in timings), wall_s)


@dataclass
class Moved:
    """What the prefill server's transfers moved for the measured requests (its counters' change), per request,
    beside the plan: one state block and every prompt page (no decode-side prefix cache here)."""
    requests: int
    transfers_per_request: float
    state_bytes_per_request: float
    kv_bytes_per_request: float
    plan_state_bytes_per_request: float
    plan_kv_bytes_per_request: float
    timed_bytes: int
    timed_seconds: float

    @property
    def ms_per_mb(self) -> float:
        return self.timed_seconds * 1e3 / (self.timed_bytes / 1e6) if self.timed_bytes else float("nan")


def plan_bytes(model: str, page_size: int, jobs: list[Job]) -> tuple[float, float]:
    """(state, KV) bytes per request that the pool geometry says the jobs move."""
    from runtime.model_files import model_config
    from runtime.pool_layout import pool_layout
    from runtime.server_args import ServerArgs

    args = ServerArgs(model=model, page_size=page_size)
    layout = pool_layout(model_config(args), args)
    kv = sum(-(-len(j.input_ids) // page_size) * layout.page_bytes for j in jobs)
    return float(layout.state_block_bytes), kv / len(jobs)


def scheduler_counters(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/get_server_info", timeout=30.0)
    r.raise_for_status()
    info = r.json()
    return info["scheduler"] | {"page_size": info["page_size"]}


def moved(before: dict[str, Any], after: dict[str, Any], n: int, plan: tuple[float, float]) -> Moved:
    d = {k: after[k] - before[k] for k in ("pd_transfers", "pd_kv_bytes", "pd_state_bytes", "pd_timed_bytes",
                                           "pd_timed_seconds")}
    return Moved(n, d["pd_transfers"] / n, d["pd_state_bytes"] / n, d["pd_kv_bytes"] / n, plan[0], plan[1],
                 d["pd_timed_bytes"], d["pd_timed_seconds"])


# --- servers and the router as processes ------------------------------------------------------------------
@contextlib.contextmanager
def server(flags: Sequence[str], log: Path, cpus: set[int] | None = None) -> Iterator[str]:
    """A radixk3 server with `flags` on a free loopback port, once /health answers; stopped on exit. `cpus`: the
    cores its processes run on (its workers size their torch threads to them)."""
    port = free_port()
    argv = [sys.executable, "-m", "radixk3.launch_server", "--host", "127.0.0.1", "--port", str(port), *flags]
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env=os.environ | {"PYTHONUNBUFFERED": "1"}, preexec_fn=pin)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while not _answers(f"{url}/health"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server {' '.join(flags)} did not start: {log.read_text()[-3000:]}")
            time.sleep(0.25)
        yield url
    finally:
        stop_process(proc)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.TransportError:
        return False


@contextlib.contextmanager
def pd_router(prefill: str, bootstrap_port: int, decode: str, log: Path) -> Iterator[str]:
    """sglang-router --pd-disaggregation in front of the two servers, once a request goes through both."""
    port = free_port()
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", prefill, str(bootstrap_port), "--decode", decode, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn",
            "--worker-startup-check-interval", "1"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited: {log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                r = httpx.post(f"{url}/generate", json={"input_ids": [FIRST_ID], "sampling_params":
                                                       {"max_new_tokens": 1}}, timeout=30.0)
                if r.status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"sglang-router routed no request in {START_S:g} s: {log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        stop_process(proc)


# --- the two modes -------------------------------------------------------------------------------------------
def warm_up(url: str, jobs: list[Job]) -> None:
    """One long and one short job alone: first-call costs (and the router's connections) out of the way."""
    for kind in ("short", "long"):
        j = next((j for j in jobs if j.kind == kind), None)
        if j is not None:  # other ids than the workload's: its prompts must not hit a cache
            asyncio.run(run_workload(url, [Job(kind, 0.0, [FIRST_ID + (t % 7) for t in j.input_ids], 2)]))


def aggregated(a: argparse.Namespace, model_flags: list[str], jobs: list[Job], tmp: Path) -> Latencies:
    with server([*model_flags, *a.server_flag], tmp / "aggregated.log") as url:
        warm_up(url, jobs)
        return latencies(*asyncio.run(run_workload(url, jobs)))


def split_cores() -> tuple[set[int] | None, set[int] | None]:
    """The machine's cores in two halves, prefill's and decode's: two servers whose torch threads both span every
    core oversubscribe it (each spin-waits for threads the other holds), which measures the contention, not P/D."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None
    return set(cores[: len(cores) // 2]), set(cores[len(cores) // 2 :])


def disaggregated(a: argparse.Namespace, model_flags: list[str], model: str, jobs: list[Job],
                  tmp: Path) -> tuple[Latencies, Moved]:
    boot = free_port()
    prefill_flags = [*model_flags, *a.server_flag, "--disaggregation-mode", "prefill",
                     "--disaggregation-bootstrap-port", str(boot)]
    decode_flags = [*model_flags, *a.server_flag, "--disaggregation-mode", "decode"]
    halves = split_cores() if not a.share_cores else (None, None)
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(server(prefill_flags, tmp / "prefill.log", halves[0]))
        decode = stack.enter_context(server(decode_flags, tmp / "decode.log", halves[1]))
        url = stack.enter_context(pd_router(prefill, boot, decode, tmp / "router.log"))
        warm_up(url, jobs)
        before = scheduler_counters(prefill)
        lat = latencies(*asyncio.run(run_workload(url, jobs)))
        after = scheduler_counters(prefill)
    return lat, moved(before, after, len(jobs), plan_bytes(model, before["page_size"], jobs))


# --- main ----------------------------------------------------------------------------------------------------
QUICK = {"model": "k3-tiny", "shorts": 3, "short_tokens": 16, "short_new_tokens": 24, "longs": 2,
         "long_tokens": 1100, "long_new_tokens": 4, "long_interval": 0.3}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("k3-tiny", "k3-small"), default="k3-small",
                    help="k3-tiny (random weights), or a random k3-small checkpoint written to a temp dir")
    ap.add_argument("--shorts", type=int, default=4, help="short prompts decoding from the start")
    ap.add_argument("--short-tokens", type=int, default=32)
    ap.add_argument("--short-new-tokens", type=int, default=96)
    ap.add_argument("--longs", type=int, default=4, help="long prompts arriving while the shorts decode")
    ap.add_argument("--long-tokens", type=int, default=2048)
    ap.add_argument("--long-new-tokens", type=int, default=8)
    ap.add_argument("--long-interval", type=float, default=1.0, help="seconds between the long prompts' arrivals")
    ap.add_argument("--server-flag", action="append", default=None,
                    help="a flag for every radixk3 server, as --server-flag=--FLAG (repeat; one token each); "
                         "default: --disable-compile")
    ap.add_argument("--share-cores", action="store_true",
                    help="run the prefill and the decode server on every core (default: half the cores each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a smoke run: " + ", ".join(f"{k} {v}"
                                                                                    for k, v in QUICK.items()))
    ap.add_argument("--json", action="store_true", help="end with one JSON object of the figures")
    a = ap.parse_args(argv)
    if a.quick:
        for k, v in QUICK.items():
            setattr(a, k, v)
    if a.server_flag is None:
        a.server_flag = ["--disable-compile"]
    return a


def machine() -> dict[str, Any]:
    import torch

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "ucx_tls": os.environ.get("UCX_TLS")}


def report(a: argparse.Namespace, mach: dict[str, Any], agg: Latencies, pd: Latencies, mv: Moved) -> dict[str, Any]:
    def ms(x: float) -> str:
        return f"{x * 1e3:.0f} ms"

    print(f"machine: {mach['cpu']}, {mach['cores']} cores, torch {mach['torch']}, python {mach['python']}, "
          f"UCX_TLS={mach['ucx_tls']}")
    print(f"model {a.model}; {a.shorts} short prompts ({a.short_tokens} tokens, {a.short_new_tokens} new) from the "
          f"start, {a.longs} long prompts ({a.long_tokens} tokens, {a.long_new_tokens} new) one every "
          f"{a.long_interval:g} s; server flags {' '.join(a.server_flag)}; P/D servers on "
          f"{'every core each' if a.share_cores else 'half the cores each'}")
    print(f"{'':<12}{'TTFT mean':>10}{'p50':>9}{'p90':>9}{'long p50':>10}{'short p50':>10}"
          f"{'gap p50':>9}{'gap p90':>9}{'out tok/s':>11}")
    for name, m in (("aggregated", agg), ("P/D", pd)):
        print(f"{name:<12}{ms(m.ttft_mean_s):>10}{ms(m.ttft_p50_s):>9}{ms(m.ttft_p90_s):>9}"
              f"{ms(m.long_ttft_p50_s):>10}{ms(m.short_ttft_p50_s):>10}{ms(m.short_gap_p50_s):>9}"
              f"{ms(m.short_gap_p90_s):>9}{m.output_tok_s:>11.1f}")
    print(f"P/D / aggregated: TTFT mean x{pd.ttft_mean_s / agg.ttft_mean_s:.2f}, "
          f"p90 x{pd.ttft_p90_s / agg.ttft_p90_s:.2f}, short gap p90 x{pd.short_gap_p90_s / agg.short_gap_p90_s:.2f}, "
          f"output tok/s x{pd.output_tok_s / agg.output_tok_s:.2f}")
    print(f"moved per request: KDA state {mv.state_bytes_per_request / 1e3:.1f} kB (plan "
          f"{mv.plan_state_bytes_per_request / 1e3:.1f} kB), MLA KV {mv.kv_bytes_per_request / 1e3:.1f} kB (plan "
          f"{mv.plan_kv_bytes_per_request / 1e3:.1f} kB), in {mv.transfers_per_request:.1f} transfers; "
          f"timed writes {mv.timed_bytes / 1e6:.2f} MB in {mv.timed_seconds * 1e3:.1f} ms = {mv.ms_per_mb:.2f} ms/MB "
          f"over loopback")
    return {"machine": mach, "settings": {k: v for k, v in vars(a).items() if k != "json"},
            "aggregated": asdict(agg) | {"output_tok_s": agg.output_tok_s},
            "pd": asdict(pd) | {"output_tok_s": pd.output_tok_s},
            "ratios": {"ttft_mean": pd.ttft_mean_s / agg.ttft_mean_s, "ttft_p90": pd.ttft_p90_s / agg.ttft_p90_s,
                       "short_gap_p90": pd.short_gap_p90_s / agg.short_gap_p90_s,
                       "output_tok_s": pd.output_tok_s / agg.output_tok_s},
            "moved": asdict(mv) | {"ms_per_mb": mv.ms_per_mb,
                                   "state_vs_plan": mv.state_bytes_per_request / mv.plan_state_bytes_per_request,
                                   "kv_vs_plan": mv.kv_bytes_per_request / mv.plan_kv_bytes_per_request}}


def main(argv: Sequence[str] | None = None) -> int:
    a = parse(argv)
    os.environ.setdefault("UCX_TLS", "tcp")  # the servers inherit it: NIXL over TCP on loopback
    from radixk3.config import preset

    name = a.model
    jobs = workload(a, preset(name).vocab_size)
    with tempfile.TemporaryDirectory(prefix="radixk3-pd-") as tmpdir:
        tmp = Path(tmpdir)
        model = name  # the preset's random weights
        if a.model == "k3-small":
            from radixk3.checkpoint import write_random_checkpoint

            model = str(write_random_checkpoint(preset(name), tmp / name, seed=0))
        model_flags = ["--model", model]
        agg = aggregated(a, model_flags, jobs, tmp)
        pd, mv = disaggregated(a, model_flags, model, jobs, tmp)
    out = report(a, machine(), agg, pd, mv)
    if a.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
