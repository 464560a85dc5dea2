"""Access and overload on the real server: the API key on every endpoint but /health, the body-size limit,
503 + Retry-After beyond the bounded queue with nothing accepted dropped, and SIGTERM draining in-flight
requests to a clean exit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from radixk3.cli import build_parser
from runtime.server_args import ServerArgs
from tests.processes import alive
from tests.runtime.http_server_proc import Server, running_server

KEY = "s3cret-key"
LIMIT = 4096
MODEL = "k3-tiny"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    flags = ("--max-body-bytes", str(LIMIT), "--max-queued-requests", "3", "--graceful-shutdown-timeout", "60")
    with running_server(*flags, api_key=KEY) as s:
        yield s


def test_serve_flags() -> None:
    args = build_parser().parse_args(["serve", "--model-path", "ckpt", "--port", "1234", "--api-key", "k"])
    s = ServerArgs.from_cli_args(args)
    assert (s.model, s.port, s.api_key, s.host) == ("ckpt", 1234, "k", "127.0.0.1")
    assert ServerArgs.from_cli_args(build_parser().parse_args(["serve"])).port == 30000


def test_api_key(server: Server) -> None:
    bare = httpx.Client(base_url=server.url, timeout=30)
    assert bare.get("/health").status_code == 200  # open: load balancers probe it
    for method, path in (("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/generate"),
                         ("GET", "/get_model_info"), ("POST", "/v1/chat/completions"), ("POST", "/flush_cache")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = bare.request(method, path, headers=headers, json={"text": "x"})
            assert r.status_code == 401, (method, path, headers)
            assert "API key" in r.json()["error"]["message"] and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    out = good.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3


def test_bearer_scheme_is_case_insensitive(server: Server) -> None:
    """RFC 7235: the auth scheme is case-insensitive, and one or more spaces follow it."""
    bare = httpx.Client(base_url=server.url, timeout=30)
    for header in (f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY}", f"bEaReR {KEY}"):
        assert bare.get("/v1/models", headers={"Authorization": header}).status_code == 200, header
    for header in (f"Basic {KEY}", f"Bearer{KEY}", "Bearer", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", f"{KEY} Bearer"):
        assert bare.get("/v1/models", headers={"Authorization": header}).status_code == 401, header


def test_body_limit(server: Server) -> None:
    with server.client() as c:
        big = {"text": "x" * LIMIT, "sampling_params": {"max_new_tokens": 1}}
        r = c.post("/generate", json=big)
        assert r.status_code == 413 and f"limit of {LIMIT} bytes" in r.json()["error"]["message"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds on the bytes received
            data = orjson.dumps(big)
            for i in range(0, len(data), 1000):
                yield data[i: i + 1000]

        r = c.post("/generate", content=chunks())
        assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
        assert c.post("/generate", json={"text": "x" * 100, "sampling_params": {"max_new_tokens": 1}}
                      ).status_code == 200


def test_overload_503_and_nothing_dropped(server: Server) -> None:
    results: list[Any] = [None] * 3

    def run(i: int, tokens: int) -> None:
        with server.client() as c:
            results[i] = c.post("/generate", json={"text": "busy", "rid": f"busy-{i}", "sampling_params": {
                "max_new_tokens": tokens, "ignore_eos": True}}).json()

    threads = [threading.Thread(target=run, args=(i, 100_000)) for i in range(3)]  # fill the queue of 3
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while server.metrics()["radixk3_num_pending_reqs"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with server.client() as c:
        r = c.post("/generate", json={"text": "one more"})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert "overloaded" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "busy", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_overloaded"
        assert c.post("/abort_request", json={"abort_all": True}).json()["aborted"] == 3
    for t in threads:
        t.join(30)
    # Every accepted request was answered (here: aborted on request, with what it had generated).
    assert [res["meta_info"]["finish_reason"]["type"] for res in results] == ["abort"] * 3
    threads = [threading.Thread(target=run, args=(i, 20)) for i in range(3)]  # room again
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [res["meta_info"]["completion_tokens"] for res in results] == [20] * 3


def test_sigterm_drains_in_flight_then_exits_cleanly(server: Server) -> None:
    """Last in this file: it stops the module's server."""
    results: list[Any] = [None, None]
    started = threading.Event()

    def stream() -> None:
        usage, done = None, False
        with server.client() as c, c.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "drain me", "max_tokens": 30, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                    usage = orjson.loads(line[6:]).get("usage") or usage
                done = done or line == "data: [DONE]"
        results[0] = (usage, done)

    def full() -> None:
        with server.client() as c:
            results[1] = c.post("/generate", json={"text": "drain me", "sampling_params": {
                "max_new_tokens": 30, "ignore_eos": True}}).json()

    threads = [threading.Thread(target=stream), threading.Thread(target=full)]
    for t in threads:
        t.start()
    assert started.wait(60)
    children = [int(p) for p in subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True,
                                               text=True).stdout.split()]
    assert len(children) >= 2  # the scheduler and the worker
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # no longer accepting
        httpx.get(f"{server.url}/health", timeout=5)
    for t in threads:
        t.join(60)
    usage, done = results[0]
    assert done and usage["completion_tokens"] == 30 and results[1]["meta_info"]["completion_tokens"] == 30
    assert results[1]["meta_info"]["finish_reason"]["type"] == "length"
    assert server.proc.wait(60) == 0
    time.sleep(1.0)
    assert not [pid for pid in children if alive(pid)]  # the engine's processes went with it


def test_sigterm_aborts_what_outlives_the_grace_period(tmp_path: Path) -> None:
    """Past the grace period the server ends what is left in the API's words: a stream gets an error event then
    [DONE], a waiting client the JSON error (503); the requests are aborted and the process exits 0."""
    log = tmp_path / "stderr.txt"
    with running_server("--graceful-shutdown-timeout", "1", stderr=log) as server:
        got: dict[str, Any] = {}
        endless = {"max_new_tokens": 100_000, "ignore_eos": True}

        def stream() -> None:
            body = {"text": "endless", "stream": True, "sampling_params": endless}
            with server.client() as c, c.stream("POST", "/generate", json=body) as r:
                lines = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        got.setdefault("t_first", time.monotonic())
                got["stream"] = lines

        def full() -> None:
            with server.client() as c:
                r = c.post("/generate", json={"text": "endless too", "sampling_params": endless})
                got["full"] = (r.status_code, r.headers["content-type"], r.json())

        threads = [threading.Thread(target=stream), threading.Thread(target=full)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while "t_first" not in got or server.metrics()["radixk3_num_running_reqs"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
        assert time.monotonic() - t0 < 30  # 1 s of grace, then the rest is aborted, not served
        for t in threads:
            t.join(30)
        *events, last, done = got["stream"]
        assert done == "data: [DONE]" and events and "error" not in orjson.loads(events[-1][6:])
        error = orjson.loads(last[6:])["error"]
        assert error["code"] == "shutting_down" and "grace period" in error["message"]
        status, content_type, body = got["full"]
        assert status == 503 and content_type == "application/json" and body["error"] == error
    assert "Traceback" not in log.read_text()


def test_slow_heads_are_closed_and_a_client_leaving_mid_body_is_no_error(tmp_path: Path) -> None:
    """A connection gets --timeout-request-head seconds for each request's head (none are kept open by a client
    that never finishes one), an idle one --timeout-keep-alive seconds for its next request to begin, and a head
    64 KiB (a 431 beyond); a client that leaves while its body is read leaves no traceback in the log."""
    log = tmp_path / "stderr.txt"
    with running_server("--timeout-keep-alive", "1", "--timeout-request-head", "1", stderr=log) as server:
        address = ("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
        half_heads = []
        for _ in range(3):
            sock = socket.create_connection(address, timeout=60)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            half_heads.append(sock)
        idle = socket.create_connection(address, timeout=60)  # sends nothing at all
        for sock in [*half_heads, idle]:
            assert sock.recv(1024) == b""  # closed by the server (the socket timeout is far longer)
            sock.close()
        with socket.create_connection(address, timeout=60) as sock:  # a whole request, then half of the next
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            first = sock.recv(4096)
            assert first.startswith(b"HTTP/1.1 200")
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            while sock.recv(4096):
                pass
        with socket.create_connection(address, timeout=60) as sock:  # a head that never ends, fast: 431, closed
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            reply = b""
            try:
                for i in range(10_000):  # 80 MB, if nothing stopped it
                    sock.sendall(b"X-Pad-%d: %s\r\n" % (i, b"a" * 8000))
            except (BrokenPipeError, ConnectionResetError):
                pass
            while chunk := sock.recv(4096):
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 431") and b'"param":"headers"' in reply, reply[:200]
        for _ in range(3):  # half a body, then gone
            with socket.create_connection(address, timeout=60) as sock:
                sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100\r\n\r\n{\"text\": ")
                time.sleep(0.2)
        with server.client() as c:  # still serving
            r = c.post("/generate", json={"text": "still here", "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2
        assert server.stop() == 0
    err = log.read_text()
    assert "Traceback" not in err and "Exception in ASGI application" not in err, err


def test_bad_model_dir_is_one_line_error(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "radixk3.launch_server", "--model-path", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "radixk3 serve: error:" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_dead_engine_fails_requests_and_health() -> None:
    with running_server() as server:
        got: dict[str, Any] = {}

        def stream() -> None:
            body = {"text": "doomed", "stream": True, "sampling_params": {"max_new_tokens": 100_000,
                                                                            "ignore_eos": True}}
            with server.client() as c, c.stream("POST", "/generate", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        got["last"] = orjson.loads(line[6:])
                    if line == "data: [DONE]":
                        got["done"] = True

        t = threading.Thread(target=stream)
        t.start()
        while "last" not in got:
            time.sleep(0.05)
        children = subprocess.run(["pgrep", "-P", str(server.proc.pid), "-f", "spawn_main"], capture_output=True,
                                  text=True).stdout.split()
        os.kill(int(children[0]), signal.SIGKILL)
        t.join(30)
        assert got.get("done") and "exited" in got["last"]["error"]["message"]
        with server.client() as c:
            health = c.get("/health")
            assert health.status_code == 503 and "exited" in health.json()["error"]["message"]
            r = c.post("/generate", json={"text": "hi"})
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert server.stop() == 0
