"""Loopback load: 240 concurrent streaming clients, every sixth leaving mid-stream. Every client that stays
gets exactly the text its prompt gets alone, none is lost, and the pool is back to its baseline after.

The load is concurrent by construction, not by timing: the server is paused (/pause_generation, in place) while
the clients connect, and continued once all 240 requests are queued in the scheduler."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.runtime.http_server_proc import Server, running_server

CLIENTS = 240
LEAVE_EVERY = 6
MAX_TOKENS = 8
PROMPTS = [f"Question {i}: how many clips did Natalia sell in month {i}?" for i in range(12)]
MODEL = "k3-tiny"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server("--max-running-requests", "128") as s:
        yield s


def body(i: int) -> dict[str, Any]:
    prompt = PROMPTS[i % len(PROMPTS)]
    if i % 2:  # half /v1/completions, half native /generate: both stream paths under load
        return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    return {"text": prompt, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}, "stream": True}


async def client(c: httpx.AsyncClient, i: int, start: asyncio.Event) -> tuple[str, str | None]:
    """('left', None) for a client that disconnected on purpose, else ('done', its text)."""
    await start.wait()
    b = body(i)
    path = "/v1/completions" if "model" in b else "/generate"
    text, events = "", 0
    async with c.stream("POST", path, json=b) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            e = orjson.loads(line[6:])
            assert "error" not in e, e
            events += 1
            text = e["text"] if "text" in e and "choices" not in e else text + e["choices"][0]["text"]
            if i % LEAVE_EVERY == 0 and events == 2:
                return "left", None  # closing the stream here disconnects
    return "done", text


async def queued(c: httpx.AsyncClient) -> float:
    text = (await c.get("/metrics")).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return float(values["radixk3_num_queued_reqs"])


async def run_clients(url: str) -> list[tuple[str, str | None]]:
    limits = httpx.Limits(max_connections=CLIENTS + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        assert (await c.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
        try:
            start = asyncio.Event()
            tasks = [asyncio.create_task(client(c, i, start)) for i in range(CLIENTS)]
            start.set()
            async with asyncio.timeout(60):  # a bound on a hang, not on speed
                while await queued(c) < CLIENTS:
                    await asyncio.sleep(0.05)
        finally:
            assert (await c.post("/continue_generation")).status_code == 200
        return list(await asyncio.gather(*tasks))


def pool(m: dict[str, float]) -> float:
    return m["radixk3_state_pool_used_bytes"] + m["radixk3_kv_pool_used_bytes"]


def test_many_streaming_clients_some_leaving(server: Server) -> None:
    with server.client() as c:
        alone = [c.post("/generate", json={"text": p, "sampling_params": {"max_new_tokens": MAX_TOKENS,
                                                                           "temperature": 0}}).json()["text"]
                 for p in PROMPTS]
        server.wait_idle()
        assert c.post("/flush_cache").json()["success"]
    baseline = server.metrics()
    results = asyncio.run(run_clients(server.url))  # all CLIENTS requests were queued at once
    left = [i for i, (how, _) in enumerate(results) if how == "left"]
    assert left == list(range(0, CLIENTS, LEAVE_EVERY))
    wrong = [(i, text, alone[i % len(PROMPTS)]) for i, (how, text) in enumerate(results)
             if how == "done" and text != alone[i % len(PROMPTS)]]
    assert not wrong, wrong[:5]
    after = server.wait_idle(timeout=30)
    finished = sum(after.get(f'radixk3_requests_total{{finish_reason="{r}"}}', 0) -
                   baseline.get(f'radixk3_requests_total{{finish_reason="{r}"}}', 0) for r in ("stop", "length"))
    aborted = (after.get('radixk3_requests_total{finish_reason="abort"}', 0)
               - baseline.get('radixk3_requests_total{finish_reason="abort"}', 0))
    # Every client is accounted for: a leaver may have been served in full before its disconnect was seen.
    assert finished + aborted == CLIENTS and aborted <= len(left)
    with server.client() as c:
        assert c.post("/flush_cache").json()["success"]
    assert pool(server.metrics()) == pool(baseline)
