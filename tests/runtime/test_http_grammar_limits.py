"""Grammars that cannot hurt the server, over HTTP: a grammar over --max-grammar-bytes, one that does not compile
within --grammar-compile-timeout (while a cheap one beside it completes), one that matches nothing, a schema
nested too deeply and schema features xgrammar would not enforce are each a 400 naming the field, with no
internal path in the message."""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import httpx
import pytest

from tests.runtime.grammar_cases import REGEXES
from tests.runtime.http_server_proc import Server, running_server

PROMPT = "Question: what is it?\nAnswer:"
MAX_BYTES = 60_000
TIMEOUT_S = 8  # long enough for the second worker's cheap grammar, far too short for the slow one


@pytest.fixture(scope="module")
def server() -> Server:
    with running_server("--max-grammar-bytes", str(MAX_BYTES), "--grammar-compile-timeout", str(TIMEOUT_S)) as s:
        yield s


def generate(server: Server, grammar: dict[str, Any], max_new_tokens: int = 16) -> httpx.Response:
    with server.client() as c:
        return c.post("/generate", json={"text": PROMPT, "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0} | grammar})


def refused(r: httpx.Response, param: str, *needles: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    for needle in needles:
        assert needle in err["message"], err
    assert "/project/" not in err["message"] and ".cc:" not in err["message"], err
    return err["message"]


def test_a_grammar_over_the_size_limit_is_a_400(server: Server) -> None:
    pattern = "(" + "|".join(f"w{i:05d}" for i in range(9000)) + ")"  # valid, 63,000 bytes
    refused(generate(server, {"regex": pattern}), "regex", f"over the limit of {MAX_BYTES} bytes")
    assert generate(server, {"regex": REGEXES[0]}).status_code == 200


def test_a_slow_compile_is_a_400_while_a_cheap_grammar_beside_it_completes(server: Server) -> None:
    assert generate(server, {"regex": "(yes|no)"}).status_code == 200  # the compile workers are up
    # 2,000 properties: most of a minute of compiling against the test vocabulary, within the size limit.
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}
    assert len(json.dumps(schema, separators=(",", ":"))) < MAX_BYTES
    slow: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: slow.append(generate(server, {"json_schema": schema})))
    thread.start()
    cheap = generate(server, {"regex": REGEXES[1]}, max_new_tokens=32)
    assert not slow, "the cheap grammar waited for the slow one"
    assert cheap.status_code == 200 and re.fullmatch(REGEXES[1], cheap.json()["text"]), cheap.text
    thread.join(120)
    refused(slow[0], "json_schema", f"did not compile within {TIMEOUT_S} s")
    # Remembered: the same schema again is refused at once, without a worker.
    refused(generate(server, {"json_schema": schema}), "json_schema", f"did not compile within {TIMEOUT_S} s")


def test_a_grammar_that_matches_nothing_is_a_400(server: Server) -> None:
    refused(generate(server, {"regex": r"[^\s\S]"}), "regex", "matches no output")


@pytest.mark.parametrize("as_text", [False, True])
def test_a_schema_nested_too_deeply_says_so_without_internals(server: Server, as_text: bool) -> None:
    depth = 5_000 if as_text else 300  # as an object in the body, as deep as the body's JSON parser takes
    schema = '{"items":' * depth + "{}" + "}" * depth  # 50,002 bytes: within the size limit
    r = generate(server, {"json_schema": schema if as_text else json.loads(schema)})
    refused(r, "json_schema", "nested too deeply", "64 levels")


@pytest.mark.parametrize(("schema", "feature"), [
    ({"$ref": "http://127.0.0.1:1/x.json"}, "$ref outside the schema"),
    ({"type": "object", "properties": {"a": {"$ref": "other.json#/a"}}}, "$ref outside the schema"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf with more than one schema"),
    ({"type": "integer", "not": {"const": 3}}, "uses not"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
])
def test_unsupported_schema_features_are_400s(server: Server, schema: dict[str, Any], feature: str) -> None:
    refused(generate(server, {"json_schema": schema}), "json_schema", feature)


def test_supported_neighbours_of_the_refused_features_still_run(server: Server) -> None:
    """A local $ref, a one-schema allOf and a property named like a keyword are no unsupported features."""
    for schema in ({"$defs": {"b": {"type": "boolean"}}, "$ref": "#/$defs/b"},
                   {"allOf": [{"type": "boolean"}]},
                   {"type": "object", "properties": {"not": {"type": "boolean"}}, "required": ["not"],
                    "additionalProperties": False}):
        r = generate(server, {"json_schema": schema}, max_new_tokens=24)
        assert r.status_code == 200, (schema, r.text)


def chat_forcing(server: Server, parameters: dict[str, Any]) -> httpx.Response:
    tool = {"type": "function", "function": {"name": "lookup", "parameters": parameters}}
    with server.client() as c:
        return c.post("/v1/chat/completions", json={
            "model": "k3-tiny", "messages": [{"role": "user", "content": "look it up"}], "tools": [tool],
            "tool_choice": "required", "max_tokens": 8, "temperature": 0})


def test_a_forced_tool_calls_schemas_are_held_to_the_same_limits(server: Server) -> None:
    """tool_choice "required" compiles the tools' parameter schemas into a grammar: a schema too deep, with an
    unsupported feature, or a grammar over --max-grammar-bytes is a 400 naming the tools, not a stalled server or
    an error about an "ebnf" the client never sent."""
    param = "tools[0].function.parameters"
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(100):
        deep = {"type": "array", "items": deep}
    refused(chat_forcing(server, {"type": "object", "properties": {"x": deep}}), param, "nested too deeply")
    refused(chat_forcing(server, {"type": "object", "properties": {"x": {"not": {"type": "string"}}}}), param, "not")
    wide = {"type": "object", "properties": {f"field_{i:04d}": {"type": "string"} for i in range(3000)}}
    refused(chat_forcing(server, wide), "tools", "--max-grammar-bytes")
    ok = chat_forcing(server, {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
    assert ok.status_code == 200, ok.text
