"""The bad-input suite: malformed requests, each answered 4xx with a message naming the problem, each sent at
the same time as a good request that must still succeed with its greedy text, and the server healthy after."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.runtime.http_server_proc import Server

MODEL = "k3-tiny"
GOOD = {"text": "Natalia sold clips to", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
VOCAB = 4096  # the built-in model's; checked against /get_model_info below


def gen(**sampling: Any) -> dict[str, Any]:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 2} | sampling}


# (name, method, path, body: bytes | JSON object | None, status, words the message must hold)
CASES: list[tuple[str, str, str, Any, int, tuple[str, ...]]] = [
    # The body itself.
    ("truncated JSON", "POST", "/generate", b'{"text": "hi"', 400, ("malformed JSON",)),
    ("empty body", "POST", "/generate", b"", 400, ("empty",)),
    ("JSON array body", "POST", "/generate", b"[1, 2]", 400, ("JSON object", "list")),
    ("invalid UTF-8", "POST", "/generate", b'{"text": "\xff\xfe"}', 400, ("UTF-8",)),
    ("NaN literal", "POST", "/generate", b'{"text": "hi", "sampling_params": {"temperature": NaN}}', 400,
     ("malformed JSON",)),
    ("infinite number", "POST", "/generate", b'{"text": "hi", "sampling_params": {"temperature": 1e400}}', 400,
     ("infinity",)),
    ("huge body", "POST", "/generate", {"text": "x" * (9 << 20)}, 413, ("exceeds the limit",)),
    # Request shape (native).
    ("no prompt", "POST", "/generate", {"sampling_params": {}}, 400, ("text", "input_ids")),
    ("text and input_ids", "POST", "/generate", {"text": "a", "input_ids": [5]}, 400, ("exactly one",)),
    ("text is a number", "POST", "/generate", {"text": 123}, 400, ("text",)),
    ("empty text", "POST", "/generate", {"text": ""}, 400, ("text", "at least 1")),
    ("empty batch", "POST", "/generate", {"text": []}, 400, ("text",)),
    ("empty input_ids", "POST", "/generate", {"input_ids": []}, 400, ("input_ids",)),
    ("input_ids of strings", "POST", "/generate", {"input_ids": ["a"]}, 400, ("input_ids",)),
    ("out-of-vocab input id", "POST", "/generate", {"input_ids": [VOCAB + 7]}, 400, ("input_ids", str(VOCAB))),
    ("negative input id", "POST", "/generate", {"input_ids": [-5]}, 400, ("input_ids",)),
    ("over-long prompt", "POST", "/generate", {"input_ids": [5] * 250_000}, 400, ("capacity",)),
    ("unknown field", "POST", "/generate", {"text": "hi", "temprature": 0}, 400, ("temprature", "unknown")),
    ("sampling_params not an object", "POST", "/generate", {"text": "hi", "sampling_params": 3}, 400,
     ("sampling_params",)),
    ("list of sampling_params for one prompt", "POST", "/generate", {"text": "hi", "sampling_params": [{}]}, 400,
     ("sampling_params", "single prompt")),
    ("rid list of the wrong length", "POST", "/generate", {"text": ["a", "b"], "rid": ["x"]}, 400, ("rid",)),
    ("stream is a string", "POST", "/generate", {"text": "hi", "stream": "yes"}, 400, ("stream",)),
    ("empty rid", "POST", "/generate", {"text": "hi", "rid": ""}, 400, ("rid",)),
    ("return_logprob is 1", "POST", "/generate", {"text": "hi", "return_logprob": 1}, 400, ("return_logprob",)),
    ("negative top_logprobs_num", "POST", "/generate", {"text": "hi", "top_logprobs_num": -1}, 400,
     ("top_logprobs_num",)),
    # Sampling parameters (the engine's checks, through HTTP).
    ("unknown sampling parameter", "POST", "/generate", gen(bogus=1), 400, ("bogus",)),
    ("negative temperature", "POST", "/generate", gen(temperature=-1), 400, ("temperature",)),
    ("string temperature", "POST", "/generate", gen(temperature="hot"), 400, ("temperature",)),
    ("top_p zero", "POST", "/generate", gen(top_p=0), 400, ("top_p",)),
    ("top_k 2**63", "POST", "/generate", gen(top_k=2**63), 400, ("top_k",)),
    ("top_k 2**70", "POST", "/generate", gen(top_k=2**70), 400, ("top_k",)),
    ("negative max_new_tokens", "POST", "/generate", gen(max_new_tokens=-1), 400, ("max_new_tokens",)),
    ("fractional max_new_tokens", "POST", "/generate", gen(max_new_tokens=2.5), 400, ("max_new_tokens",)),
    ("max_new_tokens beyond capacity", "POST", "/generate", gen(max_new_tokens=10**9), 400, ("max_new_tokens",)),
    ("min_new_tokens above max", "POST", "/generate", gen(min_new_tokens=5), 400, ("min_new_tokens",)),
    ("n zero", "POST", "/generate", gen(n=0), 400, ("n ", "1")),
    ("n fractional", "POST", "/generate", gen(n=2.7), 400, ("n ",)),
    ("n a string", "POST", "/generate", gen(n="2"), 400, ("n ",)),
    ("stop a number", "POST", "/generate", gen(stop=5), 400, ("stop",)),
    ("stop an empty string", "POST", "/generate", gen(stop=[""]), 400, ("stop",)),
    ("out-of-vocab stop id", "POST", "/generate", gen(stop_token_ids=[VOCAB + 7]), 400, ("stop_token_ids",)),
    ("negative stop id", "POST", "/generate", gen(stop_token_ids=[-1769]), 400, ("stop_token_ids",)),
    ("seed a string", "POST", "/generate", gen(seed="abc"), 400, ("seed",)),
    ("repetition_penalty zero", "POST", "/generate", gen(repetition_penalty=0), 400, ("repetition_penalty",)),
    # Routing.
    ("GET on a POST route", "GET", "/generate", None, 405, ("not allowed",)),
    ("no such route", "POST", "/v2/generate", {}, 404, ("no route",)),
    ("abort without rid", "POST", "/abort_request", {}, 400, ("rid",)),
    # OpenAI chat.
    ("chat without messages", "POST", "/v1/chat/completions", {"model": MODEL}, 400, ("messages", "required")),
    ("chat with no message", "POST", "/v1/chat/completions", CHAT | {"messages": []}, 400, ("messages",)),
    ("unknown role", "POST", "/v1/chat/completions", CHAT | {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     ("role",)),
    ("content a number", "POST", "/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": 5}]}, 400,
     ("content",)),
    ("chat with a model that is no string", "POST", "/v1/chat/completions", CHAT | {"model": 7}, 400, ("model",)),
    ("unknown model", "POST", "/v1/chat/completions", CHAT | {"model": "gpt-9"}, 404, ("gpt-9", "does not exist")),
    ("max_tokens a string", "POST", "/v1/chat/completions", CHAT | {"max_tokens": "ten"}, 400, ("max_tokens",)),
    ("chat n zero", "POST", "/v1/chat/completions", CHAT | {"n": 0}, 400, ("n ",)),
    ("top_logprobs without logprobs", "POST", "/v1/chat/completions", CHAT | {"top_logprobs": 2}, 400,
     ("top_logprobs", "logprobs")),
    ("top_logprobs 50", "POST", "/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 50}, 400,
     ("top_logprobs",)),
    ("stream_options without stream", "POST", "/v1/chat/completions",
     CHAT | {"stream_options": {"include_usage": True}}, 400, ("stream_options",)),
    ("tools", "POST", "/v1/chat/completions", CHAT | {"tools": [{"type": "function"}]}, 400, ("tools",)),
    ("both max token limits", "POST", "/v1/chat/completions", CHAT | {"max_completion_tokens": 3}, 400,
     ("max_completion_tokens",)),
    ("17 stop strings", "POST", "/v1/chat/completions", CHAT | {"stop": [f"s{i}" for i in range(17)]}, 400,
     ("stop",)),
    ("frequency_penalty 3", "POST", "/v1/chat/completions", CHAT | {"frequency_penalty": 3}, 400,
     ("frequency_penalty",)),
    # logit_bias is served (issue 23; tests/runtime/test_http_sglang_fields.py); a token outside the vocabulary is not
    ("logit_bias outside the vocabulary", "POST", "/v1/chat/completions", CHAT | {"logit_bias": {str(VOCAB): 1.0}},
     400, ("logit_bias",)),
    ("json_schema response_format", "POST", "/v1/chat/completions",
     CHAT | {"response_format": {"type": "json_schema"}}, 400, ("response_format",)),
    # OpenAI completions.
    ("suffix", "POST", "/v1/completions", COMPLETION | {"suffix": "end"}, 400, ("suffix",)),
    ("logprobs 10", "POST", "/v1/completions", COMPLETION | {"logprobs": 10}, 400, ("logprobs",)),
    ("empty prompt list", "POST", "/v1/completions", COMPLETION | {"prompt": []}, 400, ("prompt",)),
    ("mixed prompt list", "POST", "/v1/completions", COMPLETION | {"prompt": [[1, 2], ["a"]]}, 400, ("prompt",)),
    ("empty prompt", "POST", "/v1/completions", COMPLETION | {"prompt": ""}, 400, ("prompt",)),
    ("completion top_p 2", "POST", "/v1/completions", COMPLETION | {"top_p": 2}, 400, ("top_p",)),
]


@pytest.fixture(scope="module")
def server(default_server: Server) -> Server:
    return default_server


def test_suite_is_large_and_distinct() -> None:
    assert len(CASES) >= 40
    assert len({name for name, *_ in CASES}) == len(CASES)
    assert len({json.dumps(c[1:4]) if not isinstance(c[3], bytes) else c[3] for c in CASES}) == len(CASES)


async def _pair(client: httpx.AsyncClient, case: tuple[str, str, str, Any, int, tuple[str, ...]]
                ) -> tuple[httpx.Response, httpx.Response]:
    _, method, path, body, _, _ = case
    kw: dict[str, Any] = {}
    if isinstance(body, bytes):
        kw = {"content": body}
    elif body is not None:  # stdlib json: orjson refuses to write 2**70
        kw = {"content": json.dumps(body).encode(), "headers": {"content-type": "application/json"}}
    bad, good = await asyncio.gather(client.request(method, path, **kw), client.post("/generate", json=GOOD))
    return bad, good


async def _run_all(url: str) -> list[tuple[httpx.Response, httpx.Response]]:
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=200)) as client:
        return list(await asyncio.gather(*(_pair(client, case) for case in CASES)))


def test_bad_requests_are_refused_clearly_and_harm_no_one(server: Server) -> None:
    with server.client() as c:
        assert c.get("/get_model_info").json()["vocab_size"] == VOCAB
        expected = c.post("/generate", json=GOOD).json()["text"]  # alone
    pairs = asyncio.run(_run_all(server.url))
    problems = []
    for (name, _, _, _, status, words), (bad, good) in zip(CASES, pairs, strict=True):
        if good.status_code != 200 or good.json()["text"] != expected:
            problems.append(f"{name}: the good request beside it got {good.status_code} {good.text[:200]}")
        if bad.status_code != status:
            problems.append(f"{name}: status {bad.status_code}, expected {status}: {bad.text[:200]}")
            continue
        error = bad.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        missing = [w for w in words if w not in error["message"]]
        if missing:
            problems.append(f"{name}: message {error['message']!r} lacks {missing}")
    assert not problems, "\n".join(problems)
    with server.client() as c:
        assert c.get("/health").status_code == 200 and c.get("/health_generate").status_code == 200
        assert c.post("/generate", json=GOOD).json()["text"] == expected
    m = server.wait_idle()
    assert m["radixk3_num_running_reqs"] == 0
