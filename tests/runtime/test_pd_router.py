"""P/D disaggregation behind the real sglang-router (`--pd-disaggregation`): one prefill and one decode radixk3 server
over NIXL (UCX over TCP on loopback), for the Kimi-Linear-format built-in model and a native K3 checkpoint, each with
and without the decode-side radix cache, always with speculation on the decode side: the built-in model with n-gram,
K3 with its MTP layer (on both servers: prefill computes the MTP latents of the prompt). Each proposer alone is also
checked with and without a decode cache hit in one process (tests/runtime/test_pd_spec.py, test_pd_local.py).
Greedy outputs through the router equal the aggregated engine's token for token, on /generate and the OpenAI
routes; a second turn's decode-side hit is the cached-token count the client sees (decode's alone, never prefill's
added); both servers' pools are back to empty after (once their caches are flushed)."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import pytest

from radixk3.checkpoint import write_random_checkpoint
from radixk3.config import preset
from runtime.local_engine import LocalEngine
from runtime.model_files import tokenizer_for
from runtime.server_args import ServerArgs
from tests.runtime.http_server_proc import Server, free_port, start_server

pytest.importorskip("nixl")
pytest.importorskip("sglang_router")

MAX_NEW = 6
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
PROMPTS = [[5, 6, 7], list(range(300, 340)), [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12]]
TEXT = "The router sends each request to both servers"
TURN2_TAIL = [7, 8, 9]  # a second turn of PROMPTS[1]'s conversation: its prompt, its output, this
# Per model: (prefill server flags, decode server flags).
DECODE_CACHE = ["--disaggregation-decode-enable-radix-cache"]
CONFIGS = {
    "kimi-linear": ([], [*DECODE_CACHE, "--speculative-algorithm", "ngram"]),
    "kimi-linear-no-decode-cache": ([], ["--speculative-algorithm", "ngram"]),
    "k3-native": (["--speculative-algorithm", "mtp"], ["--speculative-algorithm", "mtp"]),
    "k3-native-decode-cache": (["--speculative-algorithm", "mtp"], [*DECODE_CACHE, "--speculative-algorithm", "mtp"]),
}
ROUTER_STARTUP_S = 120.0


def _start_router(prefill: Server, bootstrap_port: int, decode: Server) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", prefill.url, str(bootstrap_port), "--decode", decode.url,
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn",
            "--worker-startup-check-interval", "1"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ROUTER_STARTUP_S
    while True:  # ready once a request goes through both servers
        assert proc.poll() is None, f"sglang-router exited with code {proc.returncode}"
        try:
            r = httpx.post(f"{url}/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}},
                           timeout=30)
            if r.status_code == 200:
                return url, proc
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "sglang-router did not route a request in time"
        time.sleep(0.5)


@pytest.fixture(scope="module", params=list(CONFIGS))
def pd(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """(router url, [prefill, decode] servers, the aggregated engine's greedy outputs over PROMPTS and over TEXT,
    the decode-side radix cache on, the second turn and its greedy output)."""
    model_flags: list[str] = []
    if request.param.startswith("k3-native"):
        path = write_random_checkpoint(preset("k3-tiny-native"), tmp_path_factory.mktemp("k3_native"), seed=3)
        model_flags = ["--model", str(path)]
    os.environ.setdefault("UCX_TLS", "tcp")  # the servers inherit it
    boot = free_port()
    pre_flags, dec_flags = CONFIGS[request.param]
    flags = [["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot), *pre_flags],
             ["--disaggregation-mode", "decode", *dec_flags]]
    with ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(lambda f: start_server(*model_flags, *f), flags))
        for s in servers:
            stack.callback(s.stop)
        args = ServerArgs(model=model_flags[1] if model_flags else None)
        tok = tokenizer_for(args)
        engine = LocalEngine(args)
        want = engine.generate([*PROMPTS, tok.encode(TEXT, add_bos=True)], GREEDY)
        text_out = tok.decode(want.pop())
        turn2 = PROMPTS[1] + want[1] + TURN2_TAIL
        want2 = engine.generate([turn2], GREEDY)[0]
        url, router = _start_router(servers[0], boot, servers[1])
        stack.callback(router.wait, 30)
        stack.callback(router.kill)  # the router is stateless here: no graceful drain to wait for
        yield url, servers, want, text_out, "--disaggregation-decode-enable-radix-cache" in dec_flags, turn2, want2


def _pool_empty(server: Server) -> None:
    server.wait_idle()
    with server.client() as c:
        assert c.post("/flush_cache").status_code == 200
    m = server.metrics()
    assert m["radixk3_state_pool_used_bytes"] == 0 and m["radixk3_kv_pool_used_bytes"] == 0, m


def test_generate_through_router_equals_aggregated(pd) -> None:  # noqa: ANN001
    url, servers, want, *_ = pd
    with httpx.Client(base_url=url, timeout=60) as c, ThreadPoolExecutor(len(PROMPTS)) as ex:
        got = list(ex.map(lambda p: c.post("/generate", json={"input_ids": p, "sampling_params": GREEDY}), PROMPTS))
    assert [r.status_code for r in got] == [200] * len(PROMPTS), [r.text for r in got]
    assert [r.json()["output_ids"] for r in got] == want
    for s in servers:
        _pool_empty(s)


def test_openai_routes_through_router(pd) -> None:  # noqa: ANN001
    url, servers, _, text_out, *_ = pd
    with servers[1].client() as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": TEXT, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text_out
        r = c.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    for s in servers:
        _pool_empty(s)


def test_direct_request_without_bootstrap_is_refused(pd) -> None:  # noqa: ANN001
    servers = pd[1]
    for s in servers:
        with s.client() as c:
            r = c.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 400 and "bootstrap" in r.text, r.text



def test_second_turn_through_router(pd) -> None:  # noqa: ANN001
    """With the decode-side radix cache, a conversation's second turn hits what decode kept of the first (every
    token it computed: the prompt and the outputs but the last); the response reports that hit, decode's alone
    (the prefill server's own hit, the first prompt, is not added); without it, none. Decode speculated: the
    first turn asked again drafts (n-gram: from decode's corpus, which holds the first answer)."""
    url, servers, want, _, decode_cache, turn2, want2 = pd
    decode = servers[1]
    before = decode.metrics()
    with httpx.Client(base_url=url, timeout=60) as c:
        first = c.post("/generate", json={"input_ids": PROMPTS[1], "sampling_params": GREEDY})
        second = c.post("/generate", json={"input_ids": turn2, "sampling_params": GREEDY})
        again = c.post("/generate", json={"input_ids": PROMPTS[1], "sampling_params": GREEDY})
    assert [r.status_code for r in (first, second, again)] == [200] * 3, (first.text, second.text, again.text)
    assert [r.json()["output_ids"] for r in (first, second, again)] == [want[1], want2, want[1]]
    hit = len(PROMPTS[1]) + MAX_NEW - 1 if decode_cache else 0
    assert second.json()["meta_info"]["cached_tokens"] == hit, second.json()["meta_info"]
    after = decode.wait_idle()
    steps = "radixk3_spec_verify_steps_total"
    assert after[steps] > before[steps], "decode did not speculate"
    for s in servers:
        _pool_empty(s)


def test_client_disconnect_through_router_frees_both_sides(pd, request: pytest.FixtureRequest) -> None:  # noqa: ANN001
    """A client that leaves a generation through sglang-router mid-way (streamed, or waiting for the whole
    response): the router drops its request to the decode server, which aborts it (counted as aborted), and neither
    pool keeps anything (prefill's half ended with its first token)."""
    if request.node.callspec.params["pd"] != "kimi-linear":
        pytest.skip("the router's disconnect handling does not depend on the model: one model is enough")
    url, servers, *_ = pd
    aborted = 'radixk3_requests_total{finish_reason="abort"}'
    before = servers[1].metrics().get(aborted, 0.0)
    body = {"input_ids": PROMPTS[1], "stream": True,
            "sampling_params": {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}}
    with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while not next(lines).startswith("data:"):  # decode is generating
            pass
    _until_aborted(servers[1], aborted, before + 1)
    # Unstreamed: the client gives up waiting for the whole response once decode generates.
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/generate", json.dumps({**body, "stream": False}), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 30
    while servers[1].metrics()["radixk3_num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "decode did not start the request"
        time.sleep(0.05)
    conn.close()  # before any response byte
    _until_aborted(servers[1], aborted, before + 2)
    for s in servers:
        _pool_empty(s)


def _until_aborted(server: Server, metric: str, count: float) -> None:
    deadline = time.monotonic() + 30  # far less than 4000 tokens take
    while server.metrics().get(metric, 0.0) < count:
        assert time.monotonic() < deadline, "the decode server did not abort the request its client left"
        time.sleep(0.1)
