"""Structured output over HTTP: native `sampling_params` regex / json_schema / ebnf, OpenAI `response_format`
(json_schema, json_object, text) and the `regex` extra, streamed and not; every sample (greedy and sampled,
several seeds) matches its grammar; an invalid grammar is a 400 naming the field and the problem while a good
request beside it succeeds."""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import httpx
import jsonschema
import openai
import orjson
import pytest

from tests.runtime.grammar_cases import EBNF, EBNF_AS_REGEX, MAX_NEW_TOKENS, REGEXES, SCHEMAS
from tests.runtime.http_server_proc import Server

PROMPT = "Question: what is it?\nAnswer:"
MODEL = "k3-tiny"


@pytest.fixture(scope="module")
def server(default_server: Server) -> Server:
    return default_server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def native(server: Server, grammar: dict[str, Any], stream: bool = False) -> list[str]:
    """Texts of the greedy output and of three seeded samples (seeds 7, 8, 9) under `grammar`."""
    texts = []
    with server.client() as c:
        for sp in ({"temperature": 0}, {"temperature": 1.0, "seed": 7, "n": 3}):
            body = {"text": PROMPT, "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS} | sp | grammar,
                    "stream": stream}
            if not stream:
                r = c.post("/generate", json=body)
                assert r.status_code == 200, r.text
                outs = r.json() if isinstance(r.json(), list) else [r.json()]
                assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs), outs
                texts += [o["text"] for o in outs]
                continue
            pieces: dict[int, str] = {}
            with c.stream("POST", "/generate", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        ev = orjson.loads(line[6:])
                        pieces[ev.get("index", 0)] = ev["text"]  # native events carry the text so far
            texts += list(pieces.values())
    return texts


@pytest.mark.parametrize("stream", [False, True])
def test_native_regex_json_schema_and_ebnf(server: Server, stream: bool) -> None:
    for pattern in REGEXES:
        for text in native(server, {"regex": pattern}, stream):
            assert re.fullmatch(pattern, text), (pattern, text)
    for schema in SCHEMAS:
        for text in native(server, {"json_schema": json.dumps(schema)}, stream):
            jsonschema.validate(json.loads(text), schema)
    for text in native(server, {"ebnf": EBNF}, stream):
        assert re.fullmatch(EBNF_AS_REGEX, text), text


def chat(client: openai.OpenAI, **kw: Any) -> list[Any]:
    """The greedy choice and three seeded ones, thinking off (K3 thinks by default, and the grammar holds from
    the response channel on: an untrained model would not end its reasoning)."""
    msgs = [{"role": "user", "content": "Describe a person."}]
    kw.setdefault("reasoning_effort", "none")
    greedy = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_NEW_TOKENS, temperature=0,
                                            **kw)
    sampled = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_NEW_TOKENS,
                                             temperature=1.0, seed=7, n=3, **kw)
    return greedy.choices + sampled.choices


def test_openai_response_format_json_schema(client: openai.OpenAI) -> None:
    for schema in SCHEMAS:
        fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
        for choice in chat(client, response_format=fmt):
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), schema)


def test_openai_response_format_json_object_and_text(client: openai.OpenAI) -> None:
    import xgrammar as xgr

    from radixk3.tokenizer import load_tokenizer
    from runtime.grammar import ANY_JSON, GrammarBackend, GrammarKey

    tok = load_tokenizer()
    any_json = GrammarBackend(tok, tok.vocab_size, tok.stop_ids).compile(GrammarKey("json_schema", ANY_JSON))
    for choice in chat(client, response_format={"type": "json_object"}):
        if choice.finish_reason == "stop":
            json.loads(choice.message.content)
        else:  # random weights need not close the value within max_tokens: what came is a valid JSON prefix
            assert xgr.GrammarMatcher(any_json).accept_string(choice.message.content), choice.message.content
    plain = [c.message.content for c in chat(client)]
    assert [c.message.content for c in chat(client, response_format={"type": "text"})] == plain


def test_openai_completions_regex_extra(client: openai.OpenAI) -> None:
    for pattern in REGEXES:
        for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 3, "n": 3}):
            res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_NEW_TOKENS,
                                            extra_body={"regex": pattern}, **kw)
            for choice in res.choices:
                assert re.fullmatch(pattern, choice.text), (pattern, choice.text)


@pytest.mark.parametrize(("path", "body", "param", "needle"), [
    ("/generate", {"text": PROMPT, "sampling_params": {"regex": "a(b"}}, "regex", "parenthesis is not closed"),
    ("/generate", {"text": PROMPT, "sampling_params": {"json_schema": '{"type": 5}'}}, "json_schema",
     "Type should be a string"),
    ("/generate", {"text": PROMPT, "sampling_params": {"ebnf": "root ::= foo"}}, "ebnf", 'Rule "foo" is not defined'),
    ("/generate", {"text": PROMPT, "sampling_params": {"regex": "a", "json_schema": "{}"}}, "json_schema",
     "at most one"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 7}}}}}},
     "json_schema", "invalid json_schema"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema"}}, None, "json_schema is required"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "xml"}}, None, "response_format"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "regex": "[z-a]"}, "regex", "invalid regex"),
])
def test_invalid_grammar_is_a_400_beside_a_good_request(server: Server, path: str, body: dict[str, Any],
                                                        param: str | None, needle: str) -> None:
    good: list[httpx.Response] = []

    def run_good() -> None:
        with server.client() as c:
            good.append(c.post("/generate", json={"text": PROMPT, "sampling_params": {
                "max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "regex": REGEXES[0]}}))

    t = threading.Thread(target=run_good)
    t.start()
    with server.client() as c:
        r = c.post(path, json=body)
    t.join(60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and "/project/" not in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    assert good and good[0].status_code == 200 and re.fullmatch(REGEXES[0], good[0].json()["text"])
