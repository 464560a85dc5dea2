"""radixk3 servers behind sglang-router on SGLang's gsm8k few-shot workload (bench/gsm8k.py's prompts and frontend
program): the prefix-cache hit rate of one server alone, of the servers behind `--policy cache_aware`, and of the
servers behind `--policy round_robin`, each from the servers' own /metrics (cached prompt tokens / prompt tokens
admitted, summed over the servers), and whether the routed greedy answers equal one server's.

How cache_aware decides (sglang-router 0.3.2): it keeps, per server, a tree of the request *text* it sent there
(`text` of /generate, `prompt` of /v1/completions, the messages of a chat). A request goes to the server whose
tree holds the longest prefix of its text if that prefix is more than `--cache-threshold` of the text's
characters, else to the server with the smallest tree; but while the servers are imbalanced (in-flight requests
differ by more than `--balance-abs-threshold` and the busiest has more than `--balance-rel-threshold` times the
idlest's) it goes to the least busy one. A gsm8k 5-shot prompt shares ~90% of its characters with every other, so
any threshold below that keeps it on the server that holds the few-shot prefix; the balance thresholds decide how
many requests that server takes in flight before the other one gets work (and computes the prefix once itself).

    python bench/router_hit_rate.py [--servers URL URL] [--num-questions 40] [--parallel 1] [--json]

Without `--servers` it starts two servers of k3-tiny (random weights) on loopback (`--disable-compile`: the hit rate
does not depend on it). `--parallel 1` (the default) sends the questions one after another, so every figure is
deterministic; more in flight lets the balance thresholds matter.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script, bench/ is sys.path[0] and bench/kernels.py shadows kernels

from bench.gsm8k import DATA, Workload, run_frontend, workload  # noqa: E402
from runtime.topology import free_port  # noqa: E402


def router_flags(balance_abs_threshold: int = 64) -> dict[str, tuple[str, ...]]:
    """Each policy's flags. cache_aware at sglang-router's defaults, spelled out: the cache threshold is far below
    the ~0.9 of a prompt's text that the few-shot prefix covers; at the default balance thresholds the prefix's
    server keeps every request until it has 64 more in flight than the other (with the questions sent one at a
    time: always); a lower `balance_abs_threshold` spreads a burst over both servers sooner."""
    return {"cache_aware": ("--policy", "cache_aware", "--cache-threshold", "0.3", "--balance-abs-threshold",
                            str(balance_abs_threshold), "--balance-rel-threshold", "1.5"),
            "round_robin": ("--policy", "round_robin")}


START_S = 180.0  # a server's start, or the router's registration of its servers


@dataclass(frozen=True)
class CacheCounters:
    """A server's scheduler counters: prompt tokens served from its radix cache, and all prompt tokens admitted."""
    cached: int
    admitted: int


def cache_counters(url: str) -> CacheCounters:
    r = httpx.get(f"{url}/metrics", timeout=30.0)
    r.raise_for_status()
    value = {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples}
    return CacheCounters(int(value["radixk3_cached_prompt_tokens_total"]),
                         int(value["radixk3_admitted_prompt_tokens_total"]))


def flush(url: str, timeout: float = 30.0) -> None:
    """Empty the server's radix cache; it refuses (409) until the last request's step has been released."""
    deadline = time.monotonic() + timeout
    while (r := httpx.post(f"{url}/flush_cache", timeout=timeout)).status_code == 409:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    r.raise_for_status()


@dataclass
class Served:
    """One pass of the workload through `target`: the servers' hit rate together, the greedy answers, and the
    prompt tokens each server admitted (where the requests went)."""
    hit_rate: float
    answers: list[str]
    prompt_tokens: list[int]
    cached_tokens: list[int]


def serve(target: str, servers: Sequence[str], w: Workload, parallel: int, max_new_tokens: int) -> Served:
    """The workload through `target` (a server or a router in front of `servers`), from empty caches."""
    for s in servers:
        flush(s)
    before = [cache_counters(s) for s in servers]
    from frontend_lang import RuntimeEndpoint

    endpoint = RuntimeEndpoint(target)
    try:
        opts = argparse.Namespace(max_new_tokens=max_new_tokens, parallel=parallel, no_progress=True)
        answers = run_frontend(w, endpoint, opts).answers
    finally:
        endpoint.shutdown()
    after = [cache_counters(s) for s in servers]
    cached = [a.cached - b.cached for a, b in zip(after, before, strict=True)]
    admitted = [a.admitted - b.admitted for a, b in zip(after, before, strict=True)]
    return Served(sum(cached) / sum(admitted), answers, admitted, cached)


def hit_rates(servers: Sequence[str], routers: dict[str, str], w: Workload, parallel: int = 1,
              max_new_tokens: int = 4) -> dict[str, Served]:
    """`one_server` (the first server alone), then each router in `routers` (policy -> URL) in front of all."""
    out = {"one_server": serve(servers[0], servers, w, parallel, max_new_tokens)}
    for policy, url in routers.items():
        out[policy] = serve(url, servers, w, parallel, max_new_tokens)
    return out


# --- the router and the servers as processes -----------------------------------------------------------
@contextlib.contextmanager
def launched_router(flags: Sequence[str], worker_urls: Sequence[str], log: Path) -> Iterator[str]:
    """sglang-router with `flags` on a free loopback port (its Prometheus exporter on another: the default one may
    be taken), started at once: it registers each worker when the worker answers (checked every second); stopped
    on exit."""
    port = free_port()
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-startup-check-interval", "1", "--log-level", "warn", *flags, "--worker-urls", *worker_urls]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc)


def wait_for_workers(url: str, n: int, log: Path, timeout: float = START_S) -> None:
    """Until the router at `url` lists n healthy workers."""
    deadline = time.monotonic() + timeout
    while not _all_healthy(url, n):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router did not register its workers in {timeout}s: {log.read_text()[-2000:]}")
        time.sleep(0.25)


def _all_healthy(url: str, n: int) -> bool:
    try:
        r = httpx.get(f"{url}/workers", timeout=2.0)
    except httpx.TransportError:
        return False
    workers = r.json().get("workers", []) if r.status_code == 200 else []
    return len(workers) == n and all(w.get("is_healthy") for w in workers)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Terminate, then kill after 60 s."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def local_servers(n: int, logs: Path) -> Iterator[list[str]]:
    """n servers of k3-tiny (random weights) on free loopback ports, once each answers /health."""
    procs, urls = [], []
    try:
        for i in range(n):
            port = free_port()
            with open(logs / f"server{i}.log", "wb") as log:
                cmd = [sys.executable, "-m", "radixk3.launch_server", "--port", str(port), "--model-path", "k3-tiny",
                       "--disable-compile"]
                procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                              env=os.environ | {"PYTHONUNBUFFERED": "1"}))
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + START_S
        for url, proc in zip(urls, procs, strict=True):
            while not _healthy(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server at {url} did not start (its log is in {logs})")
                time.sleep(0.25)
        yield urls
    finally:
        for proc in procs:
            stop_process(proc)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.TransportError:
        return False


# --- main ----------------------------------------------------------------------------------------------
def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", nargs="+", default=None, help="running radixk3 servers (default: start two)")
    ap.add_argument("--num-shots", type=int, default=5)
    ap.add_argument("--num-questions", type=int, default=40)
    ap.add_argument("--parallel", type=int, default=1, help="questions in flight (1: one after another)")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--balance-abs-threshold", type=int, default=64, help="cache_aware's (the router's default: 64)")
    ap.add_argument("--json", action="store_true", help="end with one JSON object of the figures")
    a = ap.parse_args(argv)
    if a.servers is not None and len(a.servers) < 2:
        ap.error("--servers needs two servers or more")
    return a


def measure(a: argparse.Namespace, servers: list[str], tmp: Path) -> dict[str, Served]:
    w = workload(DATA / "test.jsonl", DATA / "train.jsonl", a.num_shots, a.num_questions)
    with contextlib.ExitStack() as stack:
        routers = {p: stack.enter_context(launched_router(f, servers, tmp / f"router-{p}.log"))
                   for p, f in router_flags(a.balance_abs_threshold).items()}
        with ThreadPoolExecutor(len(routers)) as pool:
            list(pool.map(lambda p: wait_for_workers(routers[p], len(servers), tmp / f"router-{p}.log"), routers))
        return hit_rates(servers, routers, w, a.parallel, a.max_new_tokens)


def main(argv: Sequence[str] | None = None) -> int:
    from bench.machine_info import cpu_name

    a = parse(argv)
    with tempfile.TemporaryDirectory(prefix="radixk3-router-") as tmp:
        with contextlib.ExitStack() as stack:
            servers = a.servers or stack.enter_context(local_servers(2, Path(tmp)))
            runs = measure(a, servers, Path(tmp))
    one = runs["one_server"]
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs; {len(servers)} servers; gsm8k {a.num_shots}-shot, "
          f"{a.num_questions} questions, parallel {a.parallel}, max new tokens {a.max_new_tokens}; "
          f"cache_aware --balance-abs-threshold {a.balance_abs_threshold}")
    for name, r in runs.items():
        share = ", ".join(str(t) for t in r.prompt_tokens)
        print(f"{name:<12} cache hit rate {r.hit_rate:.3f}  (prompt tokens per server: {share}; "
              f"greedy answers {'equal' if r.answers == one.answers else 'DIFFER from'} one server's)")
    if a.json:
        print(json.dumps({"hit_rates": {k: r.hit_rate for k, r in runs.items()},
                          "answers_equal_one_server": all(r.answers == one.answers for r in runs.values()),
                          "runs": {k: asdict(r) | {"answers": None} for k, r in runs.items()},
                          "router_flags": {k: list(v) for k, v in router_flags(a.balance_abs_threshold).items()},
                          "args": vars(a)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
