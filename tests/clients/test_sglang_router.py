"""sglang-router (0.3.2 from PyPI, unchanged: `python -m sglang_router.launch_router --worker-urls ...`) in front
of two radixk3 servers on the built-in model (same weights, same seed).

The router registers each server by its info routes and forwards requests with fields of its own added
(`model`, `log_metrics`, `return_hidden_states`, ...); every route answers 200 with the greedy text one server
gives for the same request directly, streamed and not, whichever server the router picks (round robin: each
request is sent twice, once to each); `/v1/models` lists the servers' served name.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.runtime.http_server_proc import Server, free_port, start_server

NAME = "k3-routed"  # a served name of its own: the router's model id must come from the servers
PROMPT = "Natalia sold clips to 48 of her friends in April"
MAX_TOKENS = 8
ROUTER_START_S = 60.0  # after the servers are up


@dataclass
class Cluster:
    servers: list[Server]
    router_url: str

    def router(self) -> httpx.Client:
        return httpx.Client(base_url=self.router_url, timeout=60.0)


@contextlib.contextmanager
def launched_router(worker_urls: list[str], log: Path) -> Iterator[str]:
    """The router on a free loopback port (its Prometheus exporter on another: the default one may be taken),
    started at once: it registers each worker when the worker answers (checked every second); stopped on exit."""
    port = free_port()
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--policy", "round_robin", "--worker-startup-check-interval", "1", "--log-level", "warn",
            "--worker-urls", *worker_urls]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for_workers(url: str, n: int, log: Path) -> None:
    """Until the router lists n healthy workers."""
    deadline = time.monotonic() + ROUTER_START_S
    while not _all_healthy(url, n):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router did not register its workers in {ROUTER_START_S}s: "
                               f"{log.read_text()[-2000:]}")
        time.sleep(0.25)


def _all_healthy(url: str, n: int) -> bool:
    try:
        r = httpx.get(f"{url}/workers", timeout=2.0)
    except httpx.TransportError:
        return False
    workers = r.json().get("workers", []) if r.status_code == 200 else []
    return len(workers) == n and all(w.get("is_healthy") for w in workers)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The router and the two servers, all starting side by side (the router's start is seconds of imports)."""
    ports = [free_port(), free_port()]
    assert ports[0] != ports[1]
    log = tmp_path_factory.mktemp("router") / "router.log"
    servers: list[Server] = []
    with launched_router([f"http://127.0.0.1:{p}" for p in ports], log) as url:
        try:
            with ThreadPoolExecutor(2) as pool:  # each one started is stopped below
                for f in [pool.submit(start_server, "--served-model-name", NAME, port=p) for p in ports]:
                    with contextlib.suppress(Exception):
                        servers.append(f.result())
            assert len(servers) == 2, "a server did not start (its stderr is above)"
            wait_for_workers(url, len(servers), log)
            yield Cluster(servers, url)
        finally:
            for s in servers:
                s.stop()


def sse(response: httpx.Response) -> list[dict[str, Any]]:
    """The events of a stream, which must end with [DONE]."""
    assert response.status_code == 200, response.read()
    data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [orjson.loads(d) for d in data[:-1]]


def generate_text(c: httpx.Client, stream: bool) -> str:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}
    if not stream:
        r = c.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()["text"]
    with c.stream("POST", "/generate", json=body | {"stream": True}) as r:
        return sse(r)[-1]["text"]  # each event holds the text so far


def completion_text(c: httpx.Client, stream: bool) -> str:
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    if not stream:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        return "".join(e["choices"][0]["text"] for e in sse(r) if e["choices"])


def chat_message(c: httpx.Client, stream: bool) -> tuple[str, str]:
    """(reasoning_content, content): the built-in model's replies stay in K3's thinking part."""
    body = {"model": NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    if not stream:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        m = r.json()["choices"][0]["message"]
        return m.get("reasoning_content") or "", m.get("content") or ""
    with c.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        deltas = [e["choices"][0]["delta"] for e in sse(r) if e["choices"]]
    return "".join(d.get("reasoning_content") or "" for d in deltas), "".join(d.get("content") or "" for d in deltas)


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("route", [generate_text, completion_text, chat_message],
                         ids=["generate", "completions", "chat"])
def test_routed_greedy_equals_one_servers(cluster: Cluster, route: Any, stream: bool) -> None:
    with cluster.servers[0].client() as direct:
        expected = route(direct, stream=False)
    assert any(expected)  # some text came out
    before = [steps(s) for s in cluster.servers]
    with cluster.router() as c:
        assert [route(c, stream=stream) for _ in cluster.servers] == [expected] * len(cluster.servers)
    assert all(steps(s) > n for s, n in zip(cluster.servers, before, strict=True))  # round robin: one each


def steps(server: Server) -> float:
    """The server's forward steps so far (the scheduler's own count, whatever the request's log_metrics)."""
    return server.metrics()["radixk3_scheduler_steps_total"]


def test_models_lists_the_served_name(cluster: Cluster) -> None:
    with cluster.router() as c:
        r = c.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [NAME]
    workers = httpx.get(f"{cluster.router_url}/workers", timeout=10.0).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(s.url for s in cluster.servers)
    assert {w["model_id"] for w in workers} == {NAME}
