"""K3 tool calling and reasoning through the real server on the built-in model: forced calls always parse and
validate, streamed deltas reassemble to the full response, the `openai` client sees `tool_calls` and
`reasoning_content`, every chat renders in K3's own encoding (thinking on unless turned off), and bad tool
requests are 400s."""

from __future__ import annotations

from typing import Any

import jsonschema
import openai
import orjson
import pytest

from radixk3.tokenizer import load_tokenizer
from runtime.tokenizer.k3_encoding import K3ChatOptions, render_k3_chat
from tests.runtime.http_server_proc import Server

MODEL = "k3-tiny"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "opts": {"type": "object", "properties": {"metric": {"type": "boolean"}}, "required": ["metric"]}},
    "required": ["city", "opts"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {},
                                                                           "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
BASE = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 400}
# Thinking is on by default, and an untrained model does not end its reasoning: tests of calls turn it off.
NO_THINKING = {"reasoning_effort": "none"}


@pytest.fixture(scope="module")
def server(default_server: Server) -> Server:
    return default_server


def client(server: Server) -> openai.OpenAI:
    # Generous: a loaded 2-core CI machine decodes slowly; this bounds a hang, it times nothing.
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=300.0)


def check_call(call: Any, name: str | None = None) -> None:
    assert call.type == "function" and call.id.startswith(f"functions.{call.function.name}:")
    assert name is None or call.function.name == name
    jsonschema.validate(orjson.loads(call.function.arguments), SCHEMAS[call.function.name])


def sse(server: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    with server.client() as c, c.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [orjson.loads(d) for d in data[:-1]]


def reassemble(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The message a client builds from the deltas: text concatenated, calls by index, name first."""
    content, reasoning, calls, finish = "", "", {}, None
    for e in events:
        for ch in e["choices"]:
            d = ch["delta"]
            content += d.get("content") or ""
            reasoning += d.get("reasoning_content") or ""
            for t in d.get("tool_calls") or []:
                if "id" in t:
                    assert t["index"] not in calls and t["function"]["name"]
                    calls[t["index"]] = {"id": t["id"], "type": t["type"],
                                         "function": {"name": t["function"]["name"], "arguments": ""}}
                calls[t["index"]]["function"]["arguments"] += t["function"].get("arguments") or ""
            finish = ch.get("finish_reason") or finish
    return {"content": content or None, "reasoning_content": reasoning or None,
            "tool_calls": [calls[i] for i in sorted(calls)] or None, "finish_reason": finish}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_always_parse(server: Server, choice: Any) -> None:
    c = client(server)
    for seed in range(3):
        # Room for the markup spelled out in characters, should the grammar backend not pick the marker ids.
        r = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,  # type: ignore[arg-type]
                                      temperature=1.0, seed=seed, n=2, max_tokens=400, parallel_tool_calls=False,
                                      reasoning_effort="none")
        for ch in r.choices:
            assert ch.finish_reason == "tool_calls", ch
            assert ch.message.content is None and len(ch.message.tool_calls or []) == 1
            check_call(ch.message.tool_calls[0], None if choice == "required" else "get_weather")


def test_streamed_deltas_equal_the_full_response(server: Server) -> None:
    cases = [BASE | NO_THINKING | {"tool_choice": "required", "temperature": 0},  # a forced call
             BASE | NO_THINKING | {"tool_choice": "required", "parallel_tool_calls": True, "temperature": 0.8,
                                   "seed": 3},
             BASE | NO_THINKING | {"temperature": 0, "max_tokens": 48},  # auto: whatever the random model writes
             BASE | {"temperature": 0, "max_tokens": 48},  # the same, thinking (by default)
             BASE | {"reasoning_effort": "high", "temperature": 0, "max_tokens": 24},  # thinking
             BASE | {"tool_choice": "required", "temperature": 0, "max_tokens": 24}]  # forced after thinking
    with server.client() as h:
        for body in cases:
            full = h.post("/v1/chat/completions", json=body).json()["choices"][0]
            streamed = reassemble(sse(server, body))
            msg = full["message"]
            assert streamed == {"content": msg["content"], "reasoning_content": msg["reasoning_content"] or None,
                                "tool_calls": msg["tool_calls"], "finish_reason": full["finish_reason"]}, body


def two_calls_grammar() -> str:
    """EBNF of a reply that is two `noop` calls (the markup spelled out, as the grammar backend writes it): an
    untrained model under it writes what a model calling tools in parallel would."""
    call = '<|open|>call tool="noop" index="{}"<|sep|><|close|>call<|sep|>'
    text = ("<|close|>response<|sep|><|open|>tools<|sep|>" + call.format(1) + call.format(2)
            + "<|close|>tools<|sep|><|close|>message<|sep|>")
    return "root ::= " + orjson.dumps(text).decode()


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_one_call_under_auto(server: Server, stream: bool) -> None:
    """`parallel_tool_calls: false` with tool_choice auto: a reply written with two calls comes back with the
    first only, and a stream never sends the second (its text is dropped: it is not content either)."""
    body = BASE | NO_THINKING | {"ebnf": two_calls_grammar(), "temperature": 0}
    with server.client() as h:
        both = h.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert [t["function"]["name"] for t in both["message"]["tool_calls"]] == ["noop", "noop"]  # the model wrote two
    one = body | {"parallel_tool_calls": False}
    if stream:
        events = sse(server, one)
        assert all(t["index"] == 0 for e in events for ch in e["choices"]
                   for t in ch["delta"].get("tool_calls") or []), "a second call was streamed"
        got = reassemble(events)
    else:
        with server.client() as h:
            ch = h.post("/v1/chat/completions", json=one).json()["choices"][0]
        got = ch["message"] | {"finish_reason": ch["finish_reason"]}
    assert got["tool_calls"] == both["message"]["tool_calls"][:1]
    assert got["content"] is None and got["finish_reason"] == "tool_calls"


def test_reasoning_content_in_the_openai_client(server: Server) -> None:
    c = client(server)
    r = c.chat.completions.create(model=MODEL, messages=ASK, reasoning_effort="high", max_tokens=16, temperature=0)
    msg = r.choices[0].message
    # Random weights rarely close the think block within 16 tokens: the reply is all reasoning so far.
    assert isinstance(msg.model_extra.get("reasoning_content"), str) and msg.model_extra["reasoning_content"]
    off = c.chat.completions.create(model=MODEL, messages=ASK, reasoning_effort="none", max_tokens=8, temperature=0)
    assert off.choices[0].message.model_extra.get("reasoning_content") is None
    # Prompt lengths show what was rendered: the effort message and "<|open|>think<|sep|>", or neither.
    tok = load_tokenizer()
    for resp, options in ((r, K3ChatOptions(effort="high")), (off, K3ChatOptions(thinking=False))):
        assert resp.usage.prompt_tokens == len(render_k3_chat(ASK, None, options).ids(tok))
    assert r.usage.prompt_tokens > off.usage.prompt_tokens


def test_auto_never_fails(server: Server) -> None:
    """Whatever the untrained model writes, markup or not, comes back as a 200 with content or calls."""
    with server.client() as h:
        for seed in range(3):
            r = h.post("/v1/chat/completions", json=BASE | NO_THINKING | {"temperature": 1.0, "seed": seed, "n": 2,
                                                                          "max_tokens": 48})
            assert r.status_code == 200, r.text
            for ch in r.json()["choices"]:
                m = ch["message"]
                assert m["content"] is not None or m["tool_calls"], m
                for t in m["tool_calls"] or []:
                    orjson.loads(t["function"]["arguments"])


def test_conversation_with_tool_results(server: Server) -> None:
    calls = [{"id": "functions.get_weather:0", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "opts": {"metric": true}}'}},
             {"id": "functions.noop:1", "type": "function", "function": {"name": "noop", "arguments": "{}"}}]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "functions.noop:1", "content": "done"},
                {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny, 21 C"}]
    r = client(server).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,  # type: ignore[arg-type]
                                               max_tokens=4, temperature=0)
    p = render_k3_chat(messages, TOOLS)  # thinking on, effort max: the defaults
    assert r.usage.prompt_tokens == len(p.ids(load_tokenizer()))
    assert p.text.index("sunny, 21 C") < p.text.index("done")  # results in call order


@pytest.mark.parametrize("body, words", [
    (BASE | {"tool_choice": {"type": "function", "function": {"name": "nope"}}}, ("nope", "not in tools")),
    ({"model": MODEL, "messages": ASK, "tool_choice": "required"}, ("required", "needs tools")),
    (BASE | {"messages": [{"role": "tool", "tool_call_id": "x", "content": "r"}]}, ("no tool name",)),
    (BASE | {"messages": [{"role": "tool", "content": "r"}]}, ("tool_call_id",)),
    (BASE | {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, ("tools",)),
    (BASE | {"tool_choice": "required", "response_format": {"type": "json_object"}}, ("tool_choice",)),
    (BASE | {"reasoning_effort": "extreme"}, ("reasoning_effort",)),
    (BASE | {"reasoning_effort": "medium"}, ("low, high, max",)),
    (BASE | {"chat_template_kwargs": {"thinking_effort": "huge"}}, ("low, high, max",)),
    (BASE | {"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "foo"}}}}}]},
     ("tools: ", 'Unsupported type "foo"')),
])
def test_bad_tool_requests(server: Server, body: dict[str, Any], words: tuple[str, ...]) -> None:
    with server.client() as h:
        r = h.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        assert all(w in r.json()["error"]["message"] for w in words), r.json()
        good = h.post("/v1/chat/completions", json=BASE | {"max_tokens": 2})
        assert good.status_code == 200


def test_none_declares_the_tools_and_forbids_calls(server: Server) -> None:
    """As the checkpoint's encoding renders it: the tools declared, then a system message forbidding calls."""
    with server.client() as h:
        r = h.post("/v1/chat/completions", json=BASE | {"tool_choice": "none", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    p = render_k3_chat(ASK, TOOLS, K3ChatOptions(tool_choice="none"))
    assert "You MUST NOT call any tools" in p.text
    assert r.json()["usage"]["prompt_tokens"] == len(p.ids(load_tokenizer()))


@pytest.mark.parametrize("kwargs, options", [
    ({}, K3ChatOptions()),
    ({"chat_template_kwargs": {"thinking": False}}, K3ChatOptions(thinking=False)),
    ({"chat_template_kwargs": {"enable_thinking": False}}, K3ChatOptions(thinking=False)),
    ({"chat_template_kwargs": {"thinking_effort": "low"}}, K3ChatOptions(effort="low")),
    ({"reasoning_effort": "high", "chat_template_kwargs": {"thinking_effort": "low"}}, K3ChatOptions(effort="low")),
    ({"reasoning_effort": "none", "chat_template_kwargs": {"thinking": True}}, K3ChatOptions()),
    ({"response_format": {"type": "json_object"}, "reasoning_effort": "none"},
     K3ChatOptions(thinking=False, response_format={"type": "json_object"})),
])
def test_every_chat_renders_in_k3_encoding(server: Server, kwargs: dict[str, Any], options: K3ChatOptions) -> None:
    """A plain chat too: thinking on with effort max unless the request says otherwise."""
    with server.client() as h:
        r = h.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 2} | kwargs)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(render_k3_chat(ASK, None, options).ids(load_tokenizer()))
