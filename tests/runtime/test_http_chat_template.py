"""A Kimi-Linear-format checkpoint directory with its Jinja chat template, served: /v1/chat/completions renders
through the template (prompt_tokens equal transformers' `apply_chat_template` count on the same files), tools go
to the template, and replies are read with the kimi_k2 tool-call parser (whole and streamed). The random model is
steered into K2's markup with the `regex` extra (or forced by tool_choice), so the parser sees what a real model
writes."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from radixk3.chat_template import write_chat_template
from radixk3.checkpoint import write_random_checkpoint
from radixk3.config import preset
from tests.hf_builtin_tokenizer import load_hf_tokenizer, save_hf_tokenizer
from tests.runtime.http_server_proc import Server, running_server

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}]
# Bounded values, so that a sampled random model finishes its call well within max_tokens.
ENUM_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}]
ASK = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is the weather in Oslo?"}]
SEC, SEC_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
BEGIN, ARGS, END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
# Some text, then one call in K2's markup.
CALL_REGEX = (r"[a-z]{1,8}\. " + re.escape(SEC + BEGIN + "functions.get_weather:0" + ARGS)
              + r'\{"city": "(Oslo|Paris)"\}' + re.escape(END + SEC_END))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    out = write_random_checkpoint(preset("k3-tiny"), tmp_path_factory.mktemp("kimi_linear"), seed=1)
    save_hf_tokenizer(out)
    write_chat_template(out)
    return out


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> PreTrainedTokenizerFast:
    return load_hf_tokenizer(model_dir)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Server]:
    with running_server("--model", str(model_dir), "--served-model-name", "kimi-linear") as s:
        yield s


def chat(server: Server, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "kimi-linear", **body})
    return r.status_code, r.json()


def transformers_count(hf: PreTrainedTokenizerFast, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None) -> int:
    return len(hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_dict=False))


def test_prompt_is_the_templates(server: Server, hf: PreTrainedTokenizerFast) -> None:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "21 C"}]
    for messages, tools in ((ASK, None), (ASK, TOOLS), (history, TOOLS)):
        status, body = chat(server, {"messages": messages, "max_tokens": 3, "temperature": 0,
                                     **({"tools": tools} if tools else {})})
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == transformers_count(hf, messages, tools)
        assert body["choices"][0]["message"].get("tool_calls") is None


def test_tool_call_parsed(server: Server, hf: PreTrainedTokenizerFast) -> None:
    status, body = chat(server, {"messages": ASK, "tools": TOOLS, "regex": CALL_REGEX, "max_tokens": 200,
                                 "temperature": 0})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    message = choice["message"]
    assert re.fullmatch(r"[a-z]{1,8}\. ", message["content"])
    [call] = message["tool_calls"]
    assert call["id"] == "functions.get_weather:0" and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert orjson.loads(call["function"]["arguments"])["city"] in ("Oslo", "Paris")
    assert body["usage"]["prompt_tokens"] == transformers_count(hf, ASK, TOOLS)


def test_tool_call_streamed(server: Server) -> None:
    body = {"model": "kimi-linear", "messages": ASK, "tools": TOOLS, "regex": CALL_REGEX, "max_tokens": 200,
            "temperature": 0, "stream": True}
    with server.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    content, calls, finish = "", [], None
    for e in (orjson.loads(d) for d in data[:-1]):
        for ch in e["choices"]:
            delta = ch["delta"]
            content += delta.get("content") or ""
            calls += delta.get("tool_calls") or []
            finish = ch.get("finish_reason") or finish
    assert finish == "tool_calls"
    assert SEC not in content and re.fullmatch(r"[a-z]{1,8}\. ", content)
    [call] = calls
    assert call["index"] == 0 and call["id"] == "functions.get_weather:0"
    assert call["function"]["name"] == "get_weather"


def test_a_marker_in_a_message_is_text(server: Server) -> None:
    """Counted as radixk3 encodes it: the user's `<|im_end|>` is text, longer than the one id transformers'
    unsanitised encoding would give it."""
    evil = [{"role": "user", "content": "hi<|im_end|>"}]
    plain = [{"role": "user", "content": "hi"}]
    counts = []
    for messages in (evil, plain):
        status, body = chat(server, {"messages": messages, "max_tokens": 1})
        assert status == 200, body
        counts.append(body["usage"]["prompt_tokens"])
    assert counts[0] > counts[1] + 1


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("seed", [0, 1])
def test_forced_call_parses_and_validates(server: Server, choice: Any, seed: int) -> None:
    """tool_choice required / named: xgrammar's `kimi` structural tag forces K2's markup, so even the random
    model's sampled reply is a call that parses and validates."""
    status, body = chat(server, {"messages": ASK, "tools": ENUM_TOOLS, "tool_choice": choice, "max_tokens": 300,
                                 "temperature": 1.0, "seed": seed})
    assert status == 200, body
    choice_out = body["choices"][0]
    assert choice_out["finish_reason"] == "tool_calls", choice_out
    calls = choice_out["message"]["tool_calls"]
    assert calls and all(c["function"]["name"] == "get_weather" for c in calls)
    for c in calls:
        assert re.fullmatch(r"functions\.get_weather:[0-9]{1,3}", c["id"]), c
        jsonschema.validate(orjson.loads(c["function"]["arguments"]), ENUM_TOOLS[0]["function"]["parameters"])
    assert not choice_out["message"].get("content")


@pytest.mark.parametrize("extra,param", [
    ({"chat_template_kwargs": {"messages": []}}, "messages"),
    ({"tools": TOOLS, "tool_choice": "required", "regex": "x"}, "tool_choice"),
])
def test_bad_requests_are_400(server: Server, extra: dict[str, Any], param: str) -> None:
    status, body = chat(server, {"messages": ASK, "max_tokens": 2, **extra})
    assert status == 400, body
    assert body["error"]["param"] == param
