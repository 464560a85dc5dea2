"""The reliability soak (issue 27): a real `radixk3 serve` on loopback takes a storm of good, malformed, huge-n,
huge-grammar, slow-grammar and long-prompt requests beside 200 streaming clients (native /generate and
/v1/chat/completions SSE), a share of which leave mid-stream. It asserts that

- the server never dies: its process is alive and /health answers 200 at the end;
- every good request completes with its alone text (the text it got when sent alone, before the storm):
  greedy exactness under load, pool pressure, chunked prefill and leavers;
- every bad request gets a 4xx whose JSON error body names the field or the limit;
- after the storm and `POST /flush_cache`, nothing runs or waits, the pool holds what it held after the warm-up,
  and the resident memory of the server and its children is within 10% of its post-warm-up baseline;
- no running decode went more than one step without a token (`radixk3_decode_max_skipped_steps`, counted by the
  scheduler in steps, never in seconds: the project has no timed assertions).

Bounded by count, not by time: it runs in the default suite (`make test`) at its default size, about 90 s on a
2-core machine; marked `soak` (`pytest -m soak` runs it alone, `-m "not soak"` leaves it out).
RADIXK3_SOAK_SCALE=N multiplies every count for a longer run; RADIXK3_SOAK_KINDS=good,malformed,... (default:
every kind) runs part of the mix, to look into one kind.

Two kinds assert the behaviour of door limits that land with their own branches: huge `n` is a 400 naming `n`
(the door's limit on samples per request; before it, such a request is a 503 or worse), and an oversized
`json_schema` is a 400 naming `json_schema` (the grammar size limit; before it, the grammar compiles for minutes).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.runtime.http_server_proc import Server, running_server
from tests.runtime.test_http_bad_input import CASES

pytestmark = pytest.mark.soak

SCALE = float(os.environ.get("RADIXK3_SOAK_SCALE", "1"))
KINDS = ("good", "malformed", "huge_n", "huge_grammar", "slow_grammar", "long")
ACTIVE = frozenset(os.environ.get("RADIXK3_SOAK_KINDS", ",".join(KINDS)).split(","))
assert ACTIVE <= set(KINDS), f"RADIXK3_SOAK_KINDS: unknown kinds {sorted(ACTIVE - set(KINDS))}"


def scaled(n: int) -> int:
    return max(1, round(n * SCALE))


MODEL = "k3-tiny"
SEED = 27
CLIENTS = scaled(200)  # streaming clients, every LEAVE_EVERY-th of which leaves after its LEAVE_AFTER-th event
LEAVE_EVERY = 5
LEAVE_AFTER = 2
MAX_NEW = 12
PROMPTS = [f"Question {i}: Natalia sold {7 * i + 3} clips in month {i}. How many did she sell in all?"
           for i in range(8)]
LONG_PROMPTS = scaled(2)
LONG_SHARE = 0.9  # a long prompt's length, as a share of the pool's per-request capacity
LONG_NEW = 6
HUGE_N = (10_000, 100_000)  # far above any limit on n (OpenAI's is 128)
HUGE_NS = scaled(4)
HUGE_GRAMMARS = scaled(2)
HUGE_GRAMMAR_BYTES = 4 << 20  # above any limit on a grammar's size, below the 8 MiB body limit
SLOW_GRAMMARS = scaled(2)
SLOW_GRAMMAR_PROPERTIES = 700  # optional properties: xgrammar takes about a second (1,500: 10 s; 2,500: a minute)
MALFORMED_ROUNDS = scaled(1)  # every malformed case of the bad-input suite, this many times
CLIENT_TIMEOUT = 300.0  # generous: a 2-core machine shared with other work; never a timing assertion
MAX_CONNECTIONS = 512  # a scaled-up storm queues for connections beyond this (the default size runs all at once)
RSS_TOLERANCE = 0.10
# A small pool: per-request capacity about 3,000 tokens, about 40 requests' states at once, so the storm runs
# under memory pressure (admission waits for memory, the cache evicts) and a long prompt prefills in many chunks.
SERVER_FLAGS = ("--mem-bytes", "1000000", "--chunked-prefill-size", "256")

# Malformed requests beyond the bad-input suite's: (name, path, body, status, words the message must hold).
EXTRA_MALFORMED: list[tuple[str, str, Any, int, tuple[str, ...]]] = [
    ("invalid regex", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "regex": "[z-a]"}},
     400, ("regex",)),
    ("invalid json_schema", "/generate",
     {"text": "hi", "sampling_params": {"max_new_tokens": 2, "json_schema": '{"type": 5}'}}, 400, ("json_schema",)),
    ("chat stream with negative max_tokens", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3, "stream": True}, 400,
     ("max_", "-3")),  # (the engine checks the range: its message says max_new_tokens)
]


@dataclass(frozen=True)
class Outcome:
    """What a client got: the HTTP status, its text (a good request; for a chat stream its content and its
    reasoning), the JSON error object (a refused request), or that it left on purpose."""

    status: int
    text: Any = None
    error: dict[str, Any] | None = None
    left: bool = False


@dataclass(frozen=True)
class Call:
    kind: str
    name: str
    send: Callable[[httpx.AsyncClient], Awaitable[Outcome]]
    check: Callable[[Outcome], str | None]  # None when the outcome is right, else what is wrong


# --- the requests ---------------------------------------------------------------------------------------
def native_stream_body(prompt: str) -> dict[str, Any]:
    return {"text": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}, "stream": True}


def chat_stream_body(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_NEW,
            "temperature": 0, "stream": True}


def error_of(r: httpx.Response) -> dict[str, Any] | None:
    try:
        body = r.json()
    except ValueError:
        return None
    return body.get("error") if isinstance(body, dict) else None


async def stream(c: httpx.AsyncClient, path: str, body: dict[str, Any], leave_after: int | None = None) -> Outcome:
    """An SSE stream read to its end (or left after `leave_after` events): the native stream's text so far is in
    every event; a chat stream's deltas add up to its content (and reasoning)."""
    async with c.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return Outcome(r.status_code, error=error_of(r))
        text, reasoning, events = "", "", 0
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            e = orjson.loads(line[6:])
            if "error" in e:
                return Outcome(r.status_code, error=e["error"])
            events += 1
            if "choices" not in e:
                text = e["text"]
            elif e["choices"]:
                delta = e["choices"][0]["delta"]
                text += delta.get("content") or ""
                reasoning += delta.get("reasoning_content") or ""
            if events == leave_after:
                return Outcome(200, left=True)  # closing the stream here disconnects
    return Outcome(200, text=(text, reasoning) if path.startswith("/v1/chat") else text)


async def post(c: httpx.AsyncClient, path: str, body: Any, method: str = "POST") -> Outcome:
    """A plain request; `body` is raw bytes, a JSON value (written by the stdlib: orjson refuses 2**70) or None."""
    kw: dict[str, Any] = {}
    if isinstance(body, bytes):
        kw = {"content": body}
    elif body is not None:
        kw = {"content": json.dumps(body).encode(), "headers": {"content-type": "application/json"}}
    r = await c.request(method, path, **kw)
    if r.status_code != 200:
        return Outcome(r.status_code, error=error_of(r))
    return Outcome(200, text=r.json()["text"] if path == "/generate" else r.json())


def refused(status: int, words: tuple[str, ...] = (), param: str | None = None) -> Callable[[Outcome], str | None]:
    """The check of a bad request: this status, a JSON error naming the problem (its words, or its param)."""

    def check(o: Outcome) -> str | None:
        if o.status != status:
            return f"status {o.status}, expected {status}: {o.error or o.text!r:.300}"
        if o.error is None or not isinstance(o.error.get("message"), str):
            return f"no JSON error body: {o.text!r:.300}"
        missing = [w for w in words if w not in o.error["message"]]
        if missing:
            return f"the message {o.error['message']!r:.300} lacks {missing}"
        if param is not None and o.error.get("param") != param and not re.search(rf"\b{param}\b", o.error["message"]):
            return f"the error names neither param {param!r} nor the limit: {o.error}"
        return None

    return check


def completes_with(expected: Any) -> Callable[[Outcome], str | None]:
    def check(o: Outcome) -> str | None:
        if o.left:
            return None
        if o.status != 200 or o.error is not None:
            return f"status {o.status}: {o.error}"
        return None if o.text == expected else f"text {o.text!r:.200} != alone text {expected!r:.200}"

    return check


def slow_grammar_check(o: Outcome) -> str | None:
    """A slow grammar compiles (200), or runs out of its compile time or size budget: a 400 naming the field."""
    if o.status == 200 and o.error is None:
        return None
    return refused(400, param="json_schema")(o)


def optional_properties_schema(n: int, tag: str) -> str:
    return json.dumps({"type": "object", "properties": {f"{tag}_{i}": {"type": "string"} for i in range(n)}})


def huge_schema(tag: str) -> str:
    """A schema of about HUGE_GRAMMAR_BYTES, mostly a description: over any size limit, yet cheap to compile where
    no limit refuses it (a quick, harmless failure, where a huge enum would compile for minutes in gigabytes)."""
    words = " ".join(f"{tag}{i:07d}" for i in range(HUGE_GRAMMAR_BYTES // 13))
    return json.dumps({"type": "object", "description": words, "properties": {"answer": {"type": "string"}}})


def long_prompts(capacity: int, vocab: int) -> list[list[int]]:
    g = random.Random(SEED)
    n = int(capacity * LONG_SHARE) - LONG_NEW
    return [[g.randrange(16, vocab) for _ in range(n)] for _ in range(LONG_PROMPTS)]


def long_body(ids: list[int]) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": LONG_NEW, "temperature": 0}}


def bad_calls(tag: str, storm: bool) -> list[Call]:
    """The malformed, huge-n, huge-grammar and slow-grammar requests: the storm's counts, or one of each (every
    malformed case once) for the warm-up."""
    calls: list[Call] = []
    if "malformed" in ACTIVE:
        cases = CASES + [(name, "POST", *rest) for name, *rest in EXTRA_MALFORMED]
        for _ in range(MALFORMED_ROUNDS if storm else 1):
            for name, method, path, body, status, words in cases:
                stream_bad = isinstance(body, dict) and body.get("stream") is True
                send = (lambda c, p=path, b=body: stream(c, p, b)) if stream_bad else \
                    (lambda c, p=path, b=body, m=method: post(c, p, b, m))
                calls.append(Call("malformed", name, send, refused(status, words)))
    if "huge_n" in ACTIVE:
        for i in range(HUGE_NS if storm else 1):
            n = HUGE_N[i % len(HUGE_N)]
            body: dict[str, Any] = ({"text": "hi", "sampling_params": {"max_new_tokens": 1, "n": n}} if i % 2 == 0
                                    else {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 1, "n": n})
            path = "/generate" if i % 2 == 0 else "/v1/chat/completions"
            calls.append(Call("huge_n", f"n={n} on {path}", lambda c, p=path, b=body: post(c, p, b),
                              refused(400, param="n")))
    if "huge_grammar" in ACTIVE:
        for i in range(HUGE_GRAMMARS if storm else 1):
            body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "json_schema": huge_schema(f"{tag}{i}")}}
            calls.append(Call("huge_grammar", f"{HUGE_GRAMMAR_BYTES >> 20} MiB json_schema",
                              lambda c, b=body: post(c, "/generate", b), refused(400, param="json_schema")))
    if "slow_grammar" in ACTIVE:
        for i in range(SLOW_GRAMMARS if storm else 1):
            schema = optional_properties_schema(SLOW_GRAMMAR_PROPERTIES, f"{tag}{i}")  # distinct: no cache hit
            body = {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "json_schema": schema}}
            calls.append(Call("slow_grammar", f"{SLOW_GRAMMAR_PROPERTIES}-property json_schema",
                              lambda c, b=body: post(c, "/generate", b), slow_grammar_check))
    return calls


@dataclass(frozen=True)
class AloneTexts:
    native: list[str]
    chat: list[tuple[str, str]]
    long: list[str]
    long_prompts: list[list[int]]


def good_calls(alone: AloneTexts, clients: int, longs: int) -> list[Call]:
    """The streaming clients (half native, half chat; every LEAVE_EVERY-th leaves) and the first `longs` long
    prompts."""
    calls: list[Call] = []
    if "good" in ACTIVE:
        for i in range(clients):
            j = (i // 2) % len(PROMPTS)
            leave = LEAVE_AFTER if i % LEAVE_EVERY == 0 else None
            if i % 2 == 0:
                body, path, expected = native_stream_body(PROMPTS[j]), "/generate", alone.native[j]
            else:
                body, path, expected = chat_stream_body(PROMPTS[j]), "/v1/chat/completions", alone.chat[j]
            name = f"client {i} ({path}{', leaves' if leave else ''})"
            calls.append(Call("good", name, lambda c, p=path, b=body, k=leave: stream(c, p, b, k),
                              completes_with(expected)))
    if "long" in ACTIVE:
        for ids, expected in list(zip(alone.long_prompts, alone.long, strict=True))[:longs]:
            calls.append(Call("long", f"{len(ids)}-token prompt",
                              lambda c, ids=ids: post(c, "/generate", long_body(ids)), completes_with(expected)))
    return calls


async def run_calls(url: str, calls: list[Call]) -> list[Outcome]:
    """Every call at once (in the given order), each on its own connection."""
    limits = httpx.Limits(max_connections=min(len(calls), MAX_CONNECTIONS), max_keepalive_connections=0)
    timeout = httpx.Timeout(CLIENT_TIMEOUT, pool=None)  # waiting for a connection is not the server's time
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as c:
        return list(await asyncio.gather(*(call.send(c) for call in calls)))


async def run_alone(url: str, sends: list[Callable[[httpx.AsyncClient], Awaitable[Outcome]]]) -> list[Outcome]:
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT) as c:
        return [await send(c) for send in sends]


def problems(calls: list[Call], outcomes: list[Outcome]) -> list[str]:
    return [f"{call.kind} / {call.name}: {wrong}" for call, o in zip(calls, outcomes, strict=True)
            if (wrong := call.check(o)) is not None]


# --- the server's health, memory and pool -----------------------------------------------------------------
def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it, from /proc's parent links."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += parents.get(p, [])
    return tree


def resident_bytes(pid: int) -> dict[str, int]:
    """VmRSS of the server process and of each of its children, by process name (`radixk3-sched0`, ...)."""
    out: dict[str, int] = {}
    for p in process_tree(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if "VmRSS" in fields:
            out[f"{fields['Name'].strip()} ({p})"] = int(fields["VmRSS"].split()[0]) * 1024
    return out


def pool_used(m: dict[str, float]) -> float:
    return m["radixk3_state_pool_used_bytes"] + m["radixk3_kv_pool_used_bytes"]


def flush(server: Server) -> dict[str, float]:
    """Metrics once idle and flushed."""
    server.wait_idle(timeout=CLIENT_TIMEOUT)
    with server.client() as c:
        r = c.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"], r.text
    return server.metrics()


@pytest.fixture(scope="module")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("soak") / "server.stderr"


@pytest.fixture(scope="module")
def server(server_log: Path) -> Iterator[Server]:
    with running_server(*SERVER_FLAGS, stderr=server_log) as s:
        yield s


def alone_texts(server: Server) -> AloneTexts:
    """Each good request's text, sent one at a time before anything else."""
    with server.client() as c:
        info = c.get("/get_model_info").json()
    longs = long_prompts(info["context_length"], info["vocab_size"]) if "long" in ACTIVE else []
    sends = [lambda c, p=p: stream(c, "/generate", native_stream_body(p)) for p in PROMPTS]
    sends += [lambda c, p=p: stream(c, "/v1/chat/completions", chat_stream_body(p)) for p in PROMPTS]
    sends += [lambda c, ids=ids: post(c, "/generate", long_body(ids)) for ids in longs]
    outs = asyncio.run(run_alone(server.url, sends))
    assert all(o.status == 200 and o.error is None for o in outs), [o for o in outs if o.status != 200][:3]
    texts = [o.text for o in outs]
    n = len(PROMPTS)
    return AloneTexts(texts[:n], texts[n : 2 * n], texts[2 * n :], longs)


def test_soak(server: Server, server_log: Path) -> None:
    t0 = time.monotonic()
    alone = alone_texts(server)
    assert len(set(alone.native)) > 1, "the prompts' texts should differ (else exactness proves little)"
    t_alone = time.monotonic()

    # Warm-up: every kind once (a leaver too), then flush: the baseline of memory and pool.
    warm = bad_calls("warm", storm=False) + good_calls(alone, LEAVE_EVERY, longs=1)
    wrong = problems(warm, asyncio.run(run_calls(server.url, warm)))
    assert not wrong, "\n".join(wrong)
    baseline = flush(server)
    rss_baseline = resident_bytes(server.proc.pid)
    t_warm = time.monotonic()

    # The storm, in a seeded order.
    storm = bad_calls("storm", storm=True) + good_calls(alone, CLIENTS, longs=LONG_PROMPTS)
    random.Random(SEED).shuffle(storm)
    outcomes = asyncio.run(run_calls(server.url, storm))
    t_storm = time.monotonic()

    assert server.proc.poll() is None, \
        f"the server died (exit code {server.proc.returncode}); its stderr ends:\n{server_log.read_text()[-3000:]}"
    with server.client() as c:
        assert c.get("/health").status_code == 200
    wrong = problems(storm, outcomes)
    assert not wrong, f"{len(wrong)} of {len(storm)} requests went wrong:\n" + "\n".join(wrong[:40])
    kinds = {call.kind for call in storm}
    assert kinds == ACTIVE, f"the storm lacks {sorted(ACTIVE - kinds)}"
    left = sum(o.left for o in outcomes)
    if "good" in ACTIVE:  # (a leaver whose tokens all came in its first events stayed: its text was checked)
        assert left >= CLIENTS // LEAVE_EVERY // 2, f"only {left} clients left mid-stream"

    after = flush(server)
    rss_after = resident_bytes(server.proc.pid)
    total, total_baseline = sum(rss_after.values()), sum(rss_baseline.values())
    by_process = ", ".join(f"{k} {rss_baseline.get(k, 0) / 2**20:.0f} -> {v / 2**20:.0f}" for k, v in rss_after.items())
    skipped = after["radixk3_decode_max_skipped_steps"]
    # Shown on a failure (pytest prints a failed test's output), and with -s.
    print(f"\nsoak: {len(storm)} requests, {left} left mid-stream; alone {t_alone - t0:.0f}s, warm-up "
          f"{t_warm - t_alone:.0f}s, storm {t_storm - t_warm:.0f}s; decode_max_skipped_steps {skipped:.0f}; "
          f"steps {after['radixk3_scheduler_steps_total']:.0f}, retractions {after['radixk3_retractions_total']:.0f}, "
          f"evictions {after['radixk3_cache_evictions_total']:.0f}; RSS (MiB) {total_baseline / 2**20:.0f} -> "
          f"{total / 2**20:.0f}: {by_process}")
    for key in ("radixk3_num_running_reqs", "radixk3_num_queued_reqs", "radixk3_num_pending_reqs"):
        assert after[key] == 0, f"{key} = {after[key]} after the storm"
    assert pool_used(after) == pool_used(baseline), "pool blocks leaked: the pool holds more than after warm-up"
    assert skipped <= 1, f"a running decode went {skipped:.0f} steps without a token"
    assert abs(total - total_baseline) <= RSS_TOLERANCE * total_baseline, \
        f"resident memory: {total / 2**20:.0f} MiB after the storm and a flush, {total_baseline / 2**20:.0f} MiB " \
        f"after the warm-up (by process: {by_process})"
