"""The limits at the door, on the real server: n (--max-n), top logprobs (--max-logprobs), the samples of a
request or batch against the queue (--max-queued-requests), and the prompt's length; a request that can never
fit is a 400 naming the field and the flag, one that does not fit now a 503 with Retry-After; a batch is
admitted all or nothing; a refused huge n costs the server no memory."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from radixk3.tokenizer import load_tokenizer
from runtime.server_args import ServerArgs
from tests.runtime.http_server_proc import Server, running_server

MODEL = "k3-tiny"
MAX_N, MAX_LOGPROBS, MAX_QUEUED = 8, 4, 12
GOOD = {"text": "Natalia sold clips to", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    flags = ("--max-n", str(MAX_N), "--max-top-logprobs", str(MAX_LOGPROBS),
             "--max-queued-requests", str(MAX_QUEUED))
    with running_server(*flags) as s:
        yield s


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def refused(r: httpx.Response, status: int, param: str, *words: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert all(w in error["message"] for w in words), (words, error)


def test_the_defaults_and_the_flags() -> None:
    args = ServerArgs()
    assert (args.max_n, args.max_logprobs, args.max_queued_requests) == (128, 20, 4096)
    parser = __import__("argparse").ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for flag in ("--max-logprobs", "--max-top-logprobs"):
        assert ServerArgs.from_cli_args(parser.parse_args([flag, "7", "--max-n", "3"])).max_logprobs == 7
    for bad in ({"max_n": 0}, {"max_logprobs": -1}, {"max_queued_requests": 0}):
        with pytest.raises(ValueError):
            ServerArgs(**bad)


def test_a_huge_n_is_a_400_and_costs_no_memory(server: Server) -> None:
    pid = server.proc.pid  # the HTTP server and tokenizer manager
    with server.client() as c:
        assert c.post("/generate", json=GOOD).status_code == 200  # warm: what a first request allocates
        before = rss_kib(pid)
        for n in (2**40, 2_000_000, MAX_N + 1):
            r = c.post("/generate", json={"text": "hi", "sampling_params": {"n": n, "max_new_tokens": 1}})
            refused(r, 400, "n", "--max-n", str(MAX_N))
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "n": n}
            refused(c.post("/v1/completions", json=body), 400, "n", "--max-n")
            refused(c.post("/v1/completions", json=body | {"best_of": n}), 400, "n", "--max-n")
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "n": n}
            refused(c.post("/v1/chat/completions", json=chat), 400, "n", "--max-n")
        grown = rss_kib(pid) - before
        assert grown < 64 * 1024, f"the server grew by {grown} KiB refusing huge n"  # the bug: +145 MB for 2M
        assert len(c.post("/generate", json=GOOD | {"sampling_params": {"n": MAX_N, "max_new_tokens": 1}}
                          ).json()) == MAX_N


def test_top_logprobs_are_bounded(server: Server) -> None:
    with server.client() as c:
        ok = c.post("/generate", json=GOOD | {"return_logprob": True, "top_logprobs_num": MAX_LOGPROBS})
        assert ok.status_code == 200 and len(ok.json()["meta_info"]["output_top_logprobs"][0]) == MAX_LOGPROBS
        r = c.post("/generate", json=GOOD | {"return_logprob": True, "top_logprobs_num": MAX_LOGPROBS + 1})
        refused(r, 400, "top_logprobs_num", "--max-logprobs")
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "logprobs": 5})
        refused(r, 400, "logprobs", "--max-logprobs")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True}
        refused(c.post("/v1/chat/completions", json=chat | {"top_logprobs": 5}), 400, "top_logprobs", "--max-logprobs")
        assert c.post("/v1/chat/completions", json=chat | {"top_logprobs": MAX_LOGPROBS}).status_code == 200


def test_a_prompt_too_long_is_refused_before_encoding(server: Server) -> None:
    with server.client() as c:
        context = c.get("/get_model_info").json()["context_length"]
        text = "x" * (context * load_tokenizer().max_token_bytes)  # at least context + 1 tokens with the BOS
        r = c.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}})
        refused(r, 400, "text", "characters", "capacity")
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1})
        refused(r, 400, "prompt", "characters")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
        refused(c.post("/v1/chat/completions", json=chat), 400, "messages", "characters")
        # A short text with too many new tokens: max_new_tokens is to blame; before or after encoding.
        r = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": context}})
        refused(r, 400, "max_new_tokens", "capacity")
        r = c.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": context - 1}})
        refused(r, 400, "max_new_tokens", "capacity")
        assert c.post("/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def _pending(server: Server) -> int:
    return int(server.metrics()["radixk3_num_pending_reqs"])


def test_batches_are_admitted_whole_and_never_push_out_a_good_request(server: Server) -> None:
    """8 samples hold the queue (12); beside them: a batch that can never fit (400), batches that do not fit now
    (503 + Retry-After), and a good request, which succeeds; nothing of the refused batches is left pending."""
    busy: dict[str, Any] = {}

    def hold() -> None:
        with server.client() as c:
            busy["r"] = c.post("/generate", json={"text": "busy", "rid": "busy", "sampling_params": {
                "n": MAX_N, "max_new_tokens": 100_000, "ignore_eos": True}})

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        deadline = time.monotonic() + 60
        while _pending(server) < MAX_N:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with server.client() as c, server.client() as good_client:
            expected_words = ["--max-queued-requests", str(MAX_QUEUED)]
            cases = [  # (body, path, status, param)
                ({"text": ["a"] * 7, "sampling_params": {"n": 2, "max_new_tokens": 1}}, "/generate", 400, "text"),
                ({"input_ids": [[5, 6]] * (MAX_QUEUED + 1)}, "/generate", 400, "input_ids"),
                ({"model": MODEL, "prompt": ["a"] * 7, "n": 2, "max_tokens": 1}, "/v1/completions", 400, "prompt"),
                ({"text": ["a"] * 5, "sampling_params": {"max_new_tokens": 1}}, "/generate", 503, None),
                ({"text": "a", "sampling_params": {"n": 5, "max_new_tokens": 1}}, "/generate", 503, None),
                ({"model": MODEL, "prompt": ["a"] * 5, "max_tokens": 1}, "/v1/completions", 503, None),
            ]
            with ThreadPoolExecutor(len(cases) + 1) as pool:
                good = pool.submit(good_client.post, "/generate", json=GOOD)
                answers = list(pool.map(lambda case: c.post(case[1], json=case[0]), cases))
                assert good.result().status_code == 200, good.result().text
            for (_, path, status, param), r in zip(cases, answers, strict=True):
                if status == 400:
                    refused(r, 400, param, *expected_words)
                else:
                    assert r.status_code == 503 and r.headers["Retry-After"] == "1", (path, r.text)
                    assert r.json()["error"]["type"] == "server_overloaded"
            assert _pending(server) == MAX_N  # the busy samples only: no part of a refused batch was sent
            assert c.post("/abort_request", json={"rid": "busy"}).json()["aborted"] == MAX_N
    finally:
        holder.join(60)
    finish = [s["meta_info"]["finish_reason"]["type"] for s in busy["r"].json()]
    assert finish == ["abort"] * MAX_N
    server.wait_idle()
