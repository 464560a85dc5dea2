"""The real server as a subprocess: native and OpenAI routes through raw HTTP (httpx) and the `openai` client,
streaming == full responses, greedy over HTTP == `Engine.generate`, abort on disconnect, /metrics."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import httpx
import jsonschema
import openai
import orjson
import pytest
import torch

from frontend_lang.endpoint_backend import RuntimeEndpoint
from radixk3.chat_prompt import ChatPrompt
from radixk3.config import PRESET_SEED
from radixk3.tokenizer import load_tokenizer
from runtime.tokenizer.engine import Engine
from runtime.tokenizer.request_stream import token_text
from tests.frontend_lang.oracle import tiny_model
from tests.greedy import greedy_reference
from tests.runtime.http_server_proc import Server

PROMPTS = ["Natalia sold clips to 48 of her friends", "Weng earns $12 an hour", "Betty is saving money"]
GREEDY = {"max_new_tokens": 12, "temperature": 0}
MODEL = "k3-tiny"


@pytest.fixture(scope="module")
def reference(builtin_engine: Engine) -> list[dict[str, Any]]:
    return builtin_engine.generate(PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def server(default_server: Server) -> Server:
    return default_server


def sse_events(response: httpx.Response) -> list[Any]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else orjson.loads(data))
    return events


def test_native_greedy_equals_engine(server: Server, reference: list[dict[str, Any]]) -> None:
    with server.client() as c:
        batch = c.post("/generate", json={"text": PROMPTS, "sampling_params": GREEDY}).json()
        single = c.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY}).json()
        ids = c.post("/generate", json={"input_ids": load_tokenizer().encode(PROMPTS[1], add_bos=True),
                                        "sampling_params": GREEDY}).json()
    assert [r["text"] for r in batch] == [r["text"] for r in reference]
    assert [r["output_ids"] for r in batch] == [r["output_ids"] for r in reference]
    assert single["text"] == reference[0]["text"] and single["meta_info"]["completion_tokens"] == 12
    assert single["meta_info"]["finish_reason"] == {"type": "length", "matched": None}
    assert single["meta_info"]["prompt_tokens"] == reference[0]["meta_info"]["prompt_tokens"]
    assert ids["output_ids"] == reference[1]["output_ids"]


def test_stream_equals_full_native_with_stop_string(server: Server, reference: list[dict[str, Any]]) -> None:
    full_text = reference[0]["text"]
    stop = full_text[len(full_text) // 2: len(full_text) // 2 + 3]
    params = GREEDY | {"stop": [stop], "n": 2}
    with server.client() as c:
        full = c.post("/generate", json={"text": PROMPTS[0], "sampling_params": params}).json()
        with c.stream("POST", "/generate", json={"text": PROMPTS[0], "sampling_params": params, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r)
    assert events[-1] == "[DONE]"
    last = {e["index"]: e for e in events[:-1]}  # each event holds its sample's text so far
    expected = full_text[: full_text.index(stop)]
    assert [f["text"] for f in full] == [expected, expected]
    assert [last[i]["text"] for i in (0, 1)] == [expected, expected]
    assert not any(stop in e["text"] for e in events[:-1])  # never streamed, then taken back
    assert last[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_batch_stream_native(server: Server, reference: list[dict[str, Any]]) -> None:
    with server.client() as c, c.stream("POST", "/generate", json={"text": PROMPTS, "sampling_params": GREEDY,
                                                                  "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    last = {e["index"]: e for e in events[:-1]}
    assert [last[i]["text"] for i in range(3)] == [r["text"] for r in reference]
    assert all(last[i]["meta_info"]["finish_reason"]["type"] == "length" for i in range(3))


LOGPROBS = {"return_logprob": True, "top_logprobs_num": 4, "logprob_start_len": 0, "return_text_in_logprobs": True}
META_LISTS = ("input_token_logprobs", "output_token_logprobs", "output_top_logprobs")


def test_native_stream_sends_only_what_is_new(server: Server) -> None:
    """Each event holds the text so far but only the new ids and logprobs (the input ones once): the stream
    grows linearly with the tokens, and its events put together are the full response."""
    body = {"text": PROMPTS[1], "sampling_params": GREEDY | {"n": 2}} | LOGPROBS
    with server.client() as c:
        full = c.post("/generate", json=body).json()
        with c.stream("POST", "/generate", json=body | {"stream": True}) as r:
            events = sse_events(r)
    assert events[-1] == "[DONE]"
    for i, want in enumerate(full):
        mine = [e for e in events[:-1] if e["index"] == i]
        meta = want["meta_info"]
        assert meta["completion_tokens"] == 12 and len(mine) >= 2
        # linear: every token's entries are sent once, the prompt's once
        assert sum(len(e["output_ids"]) for e in mine) == 12
        assert sum(len(e["meta_info"]["output_token_logprobs"]) for e in mine) == 12
        assert sum(len(e["meta_info"]["output_top_logprobs"]) for e in mine) == 12
        assert sum(len(e["meta_info"]["input_token_logprobs"]) for e in mine) == meta["prompt_tokens"]
        assert [len(e["meta_info"]["input_token_logprobs"]) > 0 for e in mine] == [True] + [False] * (len(mine) - 1)
        # the text so far, as SGLang's clients read it; the counts so far
        assert all(mine[k + 1]["text"].startswith(mine[k]["text"]) for k in range(len(mine) - 1))
        assert [e["meta_info"]["completion_tokens"] for e in mine] == list(
            itertools.accumulate(len(e["output_ids"]) for e in mine))
        # put together: the full response
        last = mine[-1]
        assert last["text"] == want["text"] and [t for e in mine for t in e["output_ids"]] == want["output_ids"]
        counts = ("finish_reason", "prompt_tokens", "completion_tokens", "error")
        assert [last["meta_info"][k] for k in counts] == [meta[k] for k in counts]
        for key in META_LISTS:
            joined = [x for e in mine for x in e["meta_info"][key]]
            assert _ids_and_texts(joined) == _ids_and_texts(meta[key]), key
            assert _values(joined) == pytest.approx(_values(meta[key]), abs=1e-4), key


def _ids_and_texts(entries: list[Any]) -> list[Any]:
    """(token id, text) of SGLang's (logprob, id, text) triples, or of each top-logprobs row's."""
    return [_ids_and_texts(x) if x and isinstance(x[0], list) else x[1:] for x in entries]


def _values(entries: list[Any]) -> list[float]:
    """The logprobs of the triples (or rows of triples), flat; the first input token's None as NaN-free 0."""
    flat = [t for x in entries for t in (x if x and isinstance(x[0], list) else [x])]
    return [0.0 if t[0] is None else t[0] for t in flat]


def test_frontend_endpoint_streams_the_whole_logprobs(server: Server) -> None:
    """`frontend_lang`'s RuntimeEndpoint gathers the events' new logprobs into its meta_info so far."""
    endpoint = RuntimeEndpoint(server.url)
    sampling, options = {"max_new_tokens": 6, "temperature": 0}, {k: v for k, v in LOGPROBS.items()}
    prompt = ChatPrompt.plain(PROMPTS[2])
    text, meta = endpoint.generate(prompt, sampling, options)
    pieces = list(endpoint.generate_stream(prompt, sampling, options))
    endpoint.shutdown()
    streamed = pieces[-1][1]
    assert "".join(d for d, _ in pieces) == text and streamed["completion_tokens"] == 6
    for key in META_LISTS:
        assert _ids_and_texts(streamed[key]) == _ids_and_texts(meta[key]), key


def test_openai_streams_send_each_token_logprobs_once(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    kw = {"model": MODEL, "max_tokens": 10, "temperature": 0}
    full = client.completions.create(prompt=PROMPTS[0], logprobs=3, **kw)
    chunks = list(client.completions.create(prompt=PROMPTS[0], logprobs=3, stream=True, **kw))
    tokens = [t for ch in chunks for c in ch.choices if c.logprobs for t in c.logprobs.tokens]
    assert tokens == full.choices[0].logprobs.tokens and len(tokens) == full.usage.completion_tokens == 10
    messages = [{"role": "user", "content": PROMPTS[0]}]
    full_chat = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, **kw)
    stream = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, stream=True, **kw)
    content = [t.token for ch in stream for c in ch.choices if c.logprobs and c.logprobs.content
               for t in c.logprobs.content]
    assert content == [t.token for t in full_chat.choices[0].logprobs.content]
    assert len(content) == full_chat.usage.completion_tokens


def test_line_separators_are_escaped_in_events(server: Server) -> None:
    """U+2028 / U+2029 in a stream (a prompt token's text in its logprobs, and generated text) are written as JSON
    escapes: clients that split lines on Unicode line breaks (httpx's iter_lines) still get whole events."""
    tok = load_tokenizer()
    [sep] = tok.encode("\u2028", add_bos=False)  # the built-in tokenizer has a token for it
    assert tok.decode([sep]) == "\u2028"
    prompt = tok.encode("one", add_bos=True) + [sep] + tok.encode("two\u2029", add_bos=False)
    body = {"input_ids": prompt, "stream": True, "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "regex": "\u2028\u2029\u2028"}} | LOGPROBS
    with server.client() as c, c.stream("POST", "/generate", json=body) as r:
        raw = r.read()
        lines = list(r.iter_lines())
    assert "\u2028".encode() not in raw and "\u2029".encode() not in raw and b"\\u2028" in raw
    data = [line for line in lines if line]
    assert all(line.startswith("data: ") for line in data) and data[-1] == "data: [DONE]"
    events = [orjson.loads(line[6:]) for line in data[:-1]]  # every line is whole JSON
    assert events[-1]["text"] == "\u2028\u2029\u2028"
    assert "\u2028" in [text for _, _, text in events[0]["meta_info"]["input_token_logprobs"]]


def test_openai_client(server: Server, reference: list[dict[str, Any]]) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    done = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(done.choices, key=lambda c: c.index)] == [r["text"] for r in reference]
    assert done.usage.completion_tokens == 36 and done.choices[0].finish_reason == "length"
    streamed = [""] * 3
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] += ch.text
    assert streamed == [r["text"] for r in reference]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How many clips?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, n=2, seed=1)
    assert len(chat.choices) == 2 and chat.choices[0].message == chat.choices[1].message
    assert chat.choices[0].message.role == "assistant" and chat.usage.total_tokens == chat.usage.prompt_tokens + 20
    text, reasoning, usage = "", "", None  # K3 thinks by default: the reply so far may be reasoning only
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
    assert (text or None) == chat.choices[0].message.content
    assert reasoning == chat.choices[0].message.model_extra["reasoning_content"]
    assert usage is not None and usage.completion_tokens == 10
    # The prompt was seen before: the radix cache serves it, and usage says so.
    assert usage.prompt_tokens_details.cached_tokens > 0
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=messages, temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=messages)
    # SGLang's documentation sends "default": it names the served model, which the response names.
    assert client.chat.completions.create(model="default", messages=messages, max_tokens=1).model == MODEL


CHAT_SCHEMA = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "object": {"const": "chat.completion"},
        "choices": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["index", "message", "finish_reason", "logprobs"],
            "properties": {
                "message": {"type": "object", "required": ["role", "content"],
                            "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}},
                "finish_reason": {"enum": ["stop", "length"]},
                "logprobs": {"type": "object", "required": ["content"], "properties": {"content": {
                    "type": "array", "items": {"type": "object", "required": ["token", "logprob", "top_logprobs"],
                                               "properties": {"top_logprobs": {"type": "array", "maxItems": 3}}}}}},
            }}},
        "usage": {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens",
                                                  "prompt_tokens_details"]},
    },
}


def test_logprobs_raw_http(server: Server) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 3, "reasoning_effort": "none"}  # thinking off: the reply is content
    with server.client() as c:
        chat = c.post("/v1/chat/completions", json=body).json()
        native = c.post("/generate", json={"text": "Weng earns", "sampling_params": {"max_new_tokens": 4,
                        "temperature": 0}, "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
                        "return_text_in_logprobs": True}).json()
    jsonschema.validate(chat, CHAT_SCHEMA)
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(t["top_logprobs"][0]["logprob"] == t["logprob"] for t in content)  # greedy
    meta = native["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == native["output_ids"]
    assert all(row[0][1] == t for row, t in zip(meta["output_top_logprobs"], native["output_ids"], strict=True))
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] and meta["input_token_logprobs"][0][0] is None
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == meta["prompt_tokens"]
    assert all(len(row) == 2 and row[0][0] >= row[1][0] for row in meta["input_top_logprobs"][1:])
    assert "".join(p for _, _, p in meta["output_token_logprobs"]) == native["text"]


def _expected_completion_logprobs(ids: list[int], k: int) -> dict[str, list[Any]]:
    """OpenAI's legacy logprobs of `ids` (prompt then outputs) from the no-cache forward: null for the first."""
    tok = load_tokenizer()
    logp = torch.log_softmax(tiny_model(PRESET_SEED)(torch.tensor(ids)).float(), dim=-1)
    texts = [token_text(tok, t) for t in ids]
    tops: list[dict[str, float] | None] = [None]
    for t in range(1, len(ids)):
        top = logp[t - 1].topk(k)
        tops.append({token_text(tok, i): v for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)})
    return {"tokens": texts, "token_logprobs": [None] + [float(logp[t - 1, ids[t]]) for t in range(1, len(ids))],
            "top_logprobs": tops, "text_offset": [sum(map(len, texts[:i])) for i in range(len(ids))]}


def _assert_logprobs_equal(got: dict[str, Any], expect: dict[str, Any]) -> None:
    assert got["tokens"] == expect["tokens"] and got["text_offset"] == expect["text_offset"]
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    assert got["token_logprobs"][1:] == pytest.approx(expect["token_logprobs"][1:], abs=1e-4)
    for g, e in zip(got["top_logprobs"][1:], expect["top_logprobs"][1:], strict=True):
        assert g.keys() == e.keys() and list(g.values()) == pytest.approx(list(e.values()), abs=1e-4)


def test_completions_echo_with_logprobs(server: Server) -> None:
    """`echo` with `logprobs` (lm-eval's loglikelihood request, vLLM's shape): the prompt's tokens then the
    outputs', their logprobs equal to the no-cache forward; a string or token prompt; max_tokens 0 or more;
    streamed events add up to the whole response."""
    tok = load_tokenizer()
    prompt = PROMPTS[1]
    prompt_ids = tok.encode(prompt, add_bos=True)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    none = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    assert none.choices[0].text == prompt and none.choices[0].finish_reason == "length"
    _assert_logprobs_equal(none.choices[0].logprobs.model_dump(), _expected_completion_logprobs(prompt_ids, 2))
    with server.client() as c:
        body = {"model": MODEL, "prompt": [prompt_ids[1:], prompt_ids], "max_tokens": 3, "temperature": 0,
                "echo": True, "logprobs": 1}
        # Each from an empty cache, so neither computes from a KDA checkpoint the other left. Whether the two
        # prompts share one prefill batch depends on when they reach the scheduler, and a batch of another
        # shape rounds differently: the streamed logprobs equal the unstreamed ones within the same tolerance.
        server.wait_idle()
        assert c.post("/flush_cache").json()["success"]
        done = c.post("/v1/completions", json=body).json()
        server.wait_idle()
        assert c.post("/flush_cache").json()["success"]
        events = sse_events(c.post("/v1/completions", json=body | {"stream": True}))
    for choice, ids in zip(sorted(done["choices"], key=lambda ch: ch["index"]), body["prompt"], strict=True):
        lp = choice["logprobs"]
        assert choice["text"].startswith(tok.decode(ids, False))
        full = ids + greedy_reference(tiny_model(PRESET_SEED), ids, 3)
        _assert_logprobs_equal(lp, _expected_completion_logprobs(full, 1))
        mine = [ch for e in events[:-1] for ch in e["choices"] if ch["index"] == choice["index"]]
        assert "".join(ch["text"] for ch in mine) == choice["text"]
        streamed = {key: [x for ch in mine for x in ch["logprobs"][key]]
                    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        _assert_logprobs_equal(streamed, lp)


def test_native_endpoints(server: Server) -> None:
    with server.client() as c:
        info = c.get("/get_model_info").json()
        assert info["vocab_size"] > 0 and info["served_model_name"] == MODEL and info["context_length"] > 0
        assert c.get("/get_server_info").json()["port"] == int(server.url.rsplit(":", 1)[1])
        assert c.get("/health_generate").status_code == 200
        server.wait_idle()
        assert c.post("/flush_cache").json()["success"] is True
        # Aborting by the request's id: the waiting client gets its answer at once, finish_reason abort.
        out: dict[str, Any] = {}
        long = {"text": "abort me", "rid": "to-abort",
                "sampling_params": {"max_new_tokens": 100_000, "ignore_eos": True}}
        t = threading.Thread(target=lambda: out.update(c.post("/generate", json=long).json()))
        t.start()
        deadline = time.monotonic() + 30
        while c.post("/abort_request", json={"rid": "to-abort"}).json()["aborted"] != 1:  # until it is in
            assert time.monotonic() < deadline
            time.sleep(0.1)
        t.join(30)
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["meta_info"]["completion_tokens"] < 100_000


def pool_bytes(m: dict[str, float]) -> float:
    return m["radixk3_state_pool_used_bytes"] + m["radixk3_kv_pool_used_bytes"]


def test_disconnect_aborts_and_frees_the_pool(server: Server) -> None:
    with server.client() as c:
        server.wait_idle()
        assert c.post("/flush_cache").json()["success"]
        before = server.metrics()
        long = {"max_new_tokens": 100_000, "ignore_eos": True}
        for i in range(3):  # streaming clients that leave after two events
            with c.stream("POST", "/generate", json={"text": f"stream {i}", "sampling_params": long,
                                                     "stream": True}) as r:
                it = r.iter_lines()
                seen = [line for line in (next(it) for _ in range(4)) if line]
                assert len(seen) == 2
        with c.stream("POST", "/v1/chat/completions", json={"model": MODEL, "stream": True, "max_tokens": 100_000,
                      "ignore_eos": True, "messages": [{"role": "user", "content": "go"}]}) as r:
            next(r.iter_lines())
        with pytest.raises(httpx.ReadTimeout):  # a full-response client that gives up
            c.post("/generate", json={"text": "full", "sampling_params": long}, timeout=1.5)
        t0 = time.monotonic()
        after = server.wait_idle(timeout=20)
        assert time.monotonic() - t0 < 20  # 5 x 100,000 tokens would take an hour: they were aborted
        assert c.post("/flush_cache").json()["success"]
        flushed = server.metrics()
    aborted = 'radixk3_requests_total{finish_reason="abort"}'
    assert after[aborted] - before.get(aborted, 0) == 5
    assert pool_bytes(flushed) == pool_bytes(before)


def test_metrics_move(server: Server) -> None:
    server.wait_idle()
    before = server.metrics()
    with server.client() as c:
        r = c.post("/generate", json={"text": "count me", "sampling_params": {"max_new_tokens": 5,
                                                                               "ignore_eos": True}}).json()
    after = server.metrics()
    length = 'radixk3_requests_total{finish_reason="length"}'
    assert after[length] - before.get(length, 0) == 1
    assert after["radixk3_generation_tokens_total"] - before["radixk3_generation_tokens_total"] == 5
    assert after["radixk3_prompt_tokens_total"] - before["radixk3_prompt_tokens_total"] == r["meta_info"][
        "prompt_tokens"]
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert after[f"radixk3_{h}_count"] - before[f"radixk3_{h}_count"] == 1
    assert after["radixk3_inter_token_latency_seconds_count"] - before["radixk3_inter_token_latency_seconds_count"] == 4
    assert after["radixk3_prefill_tokens_computed_total"] > before["radixk3_prefill_tokens_computed_total"]
    assert after["radixk3_scheduler_steps_total"] > before["radixk3_scheduler_steps_total"]
    assert 0 <= after["radixk3_cache_hit_rate"] <= 1 and after["radixk3_num_pending_reqs"] == 0
