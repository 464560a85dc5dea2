"""sglang-router (0.3.2 from PyPI, unchanged: `python -m sglang_router.launch_router --worker-urls ...`) in front
of two radixk3 servers on the built-in model (same weights, same seed).

The router registers each server by its info routes and forwards requests with fields of its own added
(`model`, `log_metrics`, `return_hidden_states`, ...); every route answers 200 with the greedy text one server
gives for the same request directly, streamed and not, whichever server the router picks (round robin: each
request is sent twice, once to each); `/v1/models` lists the servers' served name; the router's /flush_cache
flushes both servers. On gsm8k 5-shot (bench/router_hit_rate.py's measurement) the two servers behind
`--policy cache_aware` keep one server's cache hit rate, round robin's is clearly lower, and the greedy answers are
one server's whichever router serves them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from bench.gsm8k import DATA, workload
from bench.router_hit_rate import hit_rates, launched_router, router_flags, wait_for_workers
from tests.runtime.http_server_proc import Server, free_port, start_server

NAME = "k3-routed"  # a served name of its own: the router's model id must come from the servers
PROMPT = "Natalia sold clips to 48 of her friends in April"
MAX_TOKENS = 8
ROUTER_START_S = 60.0  # after the servers are up


@dataclass
class Cluster:
    servers: list[Server]
    routers: dict[str, str]  # policy -> URL: both routers in front of both servers

    @property
    def router_url(self) -> str:
        return self.routers["round_robin"]

    def router(self) -> httpx.Client:
        return httpx.Client(base_url=self.router_url, timeout=60.0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The routers (round robin, cache aware) and the two servers, all starting side by side (a router's start is
    seconds of imports)."""
    ports = [free_port(), free_port()]
    assert ports[0] != ports[1]
    logs = tmp_path_factory.mktemp("router")
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    servers: list[Server] = []
    with contextlib.ExitStack() as stack:
        routers = {p: stack.enter_context(launched_router(f, urls, logs / f"{p}.log"))
                   for p, f in router_flags().items()}
        try:
            with ThreadPoolExecutor(2) as pool:  # each one started is stopped below
                for f in [pool.submit(start_server, "--served-model-name", NAME, port=p) for p in ports]:
                    with contextlib.suppress(Exception):
                        servers.append(f.result())
            assert len(servers) == 2, "a server did not start (its stderr is above)"
            for policy, url in routers.items():
                wait_for_workers(url, len(servers), logs / f"{policy}.log", ROUTER_START_S)
            yield Cluster(servers, routers)
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


def test_router_flushes_and_reads_the_servers(cluster: Cluster) -> None:
    """What the router asks of a worker: /health, /get_server_info (model path, dp size: registration),
    /get_load (its /get_loads), /flush_cache (its own fans out to every worker); and /get_model_info through it."""
    with cluster.router() as c:
        assert c.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}).status_code == 200
        assert c.get("/get_model_info").json()["served_model_name"] == NAME
        loads = c.get("/get_loads").json()["workers"]
        assert sorted(w["worker"] for w in loads) == sorted(s.url for s in cluster.servers)
        assert all(isinstance(w["load"], int) and w["load"] >= 0 for w in loads)
        assert max(s.wait_idle()["radixk3_kv_pool_used_bytes"] for s in cluster.servers) > 0  # the prompt is cached
        r = c.post("/flush_cache")
    assert r.status_code == 200 and r.json()["workers_flushed"] == len(cluster.servers), r.text
    assert [s.metrics()["radixk3_kv_pool_used_bytes"] for s in cluster.servers] == [0, 0]
    workers = httpx.get(f"{cluster.routers['cache_aware']}/workers", timeout=10.0).json()["workers"]
    assert {(w["metadata"]["model_path"], w["metadata"]["dp_size"]) for w in workers} == {("k3-tiny", "1")}


GSM8K_QUESTIONS = 4  # one after another, 4 new tokens each: three passes of 4 requests


def test_gsm8k_cache_aware_keeps_one_servers_hit_rate(cluster: Cluster) -> None:
    """gsm8k 5-shot through each router, from empty caches: behind cache_aware the two servers together serve as
    many prompt tokens from their caches as one server alone (every question follows the few-shot prefix to the
    server that holds it); round robin computes the prefix on both; greedy answers are one server's."""
    w = workload(DATA / "test.jsonl", DATA / "train.jsonl", 5, GSM8K_QUESTIONS)
    runs = hit_rates([s.url for s in cluster.servers], cluster.routers, w)
    one, aware, rr = runs["one_server"], runs["cache_aware"], runs["round_robin"]
    print(f"gsm8k 5-shot, {GSM8K_QUESTIONS} questions: hit rate one server {one.hit_rate:.3f}, cache_aware "
          f"{aware.hit_rate:.3f} {aware.prompt_tokens}, round_robin {rr.hit_rate:.3f} {rr.prompt_tokens}")
    assert aware.answers == one.answers and rr.answers == one.answers
    assert any(one.answers)
    assert one.hit_rate > 0.5  # the few-shot prefix is most of every prompt
    assert abs(aware.hit_rate - one.hit_rate) <= 0.02
    assert min(rr.prompt_tokens) > 0  # both servers served
    assert rr.hit_rate < aware.hit_rate - 0.05  # the prefix computed on each server: clearly lower
