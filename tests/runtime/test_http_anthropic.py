"""Anthropic's Messages API through the real `anthropic` client against one live server on the built-in model:
`messages.create`, `messages.stream` (the client's own accumulation of the events) and `messages.count_tokens`,
with tools, a tool_result round trip and thinking; greedy replies equal what `/v1/chat/completions` gives for
the same conversation, and errors come in Anthropic's shape (the server has an API key: `x-api-key` opens it)."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import orjson
import pytest
from anthropic.types import TextBlock, ThinkingBlock, ToolUseBlock

from tests.runtime.http_server_proc import Server, running_server

MODEL = "k3-tiny"
KEY = "sk-anthropic-test"
BODY_LIMIT = 100_000
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                  "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
GREEDY = {"extra_body": {"temperature": 0}}  # the client's own types no longer list the sampling fields
OFF = {"thinking": {"type": "disabled"}}
ON = {"thinking": {"type": "enabled", "budget_tokens": 1024}}


@pytest.fixture(scope="module")
def server() -> Server:
    with running_server("--max-body-bytes", str(BODY_LIMIT), api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    # Generous: a loaded 2-core CI machine decodes slowly; this bounds a hang, it times nothing.
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, timeout=300.0, max_retries=0)


def chat(server: Server, messages: list[dict[str, Any]], **kw: Any) -> Any:
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=300.0, max_retries=0)
    return oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)  # type: ignore[arg-type]


def streamed(client: anthropic.Anthropic, **kw: Any) -> tuple[list[str], anthropic.types.Message]:
    with client.messages.stream(model=MODEL, **kw) as s:
        kinds = [e.type for e in s]
        return kinds, s.get_final_message()


def blocks(m: anthropic.types.Message) -> list[dict[str, Any]]:
    """The content blocks as data (the stream helper's blocks are its `Parsed` subclasses)."""
    return [b.model_dump(exclude={"parsed_output"}) for b in m.content]


def prompt_tokens(m: anthropic.types.Message) -> int:
    """Anthropic counts the prompt's tokens read from the cache apart."""
    return m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)


def check_events(kinds: list[str]) -> None:
    """Anthropic's order: message_start, blocks (start, deltas, stop), message_delta, message_stop."""
    raw = [k for k in kinds if k not in ("text", "thinking", "input_json")]  # the helper's own events
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"], raw
    body = raw[1:-2]
    while body:
        assert body[0] == "content_block_start", raw
        end = body.index("content_block_stop")
        assert set(body[1:end]) <= {"content_block_delta"}, raw
        body = body[end + 1:]


def test_text_equals_chat_completions_whole_and_streamed(server: Server, client: anthropic.Anthropic) -> None:
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    messages = [*ASK, {"role": "assistant", "content": "Let me see."}, {"role": "user", "content": [
        {"type": "text", "text": "Well?"}, {"type": "text", "text": " Tell me."}]}]
    m = client.messages.create(model=MODEL, max_tokens=12, system=system, messages=messages,  # type: ignore[arg-type]
                               metadata={"user_id": "u1"}, **OFF, **GREEDY)
    c = chat(server, [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, *ASK,
                      {"role": "assistant", "content": "Let me see."},
                      {"role": "user", "content": [{"type": "text", "text": "Well?"},
                                                   {"type": "text", "text": " Tell me."}]}],
             max_tokens=12, extra_body={"chat_template_kwargs": {"thinking": False}})
    assert [type(b) for b in m.content] == [TextBlock] and m.content[0].text == c.choices[0].message.content
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None and m.usage.output_tokens == 12
    assert prompt_tokens(m) == c.usage.prompt_tokens
    kinds, final = streamed(client, max_tokens=12, system=system, messages=messages, **OFF, **GREEDY)
    check_events(kinds)
    assert blocks(final) == blocks(m) and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == 12 and prompt_tokens(final) == prompt_tokens(m)
    count = client.messages.count_tokens(model=MODEL, system=system, messages=messages, **OFF)  # type: ignore[arg-type]
    assert count.input_tokens == c.usage.prompt_tokens


def test_absent_thinking_is_off(server: Server, client: anthropic.Anthropic) -> None:
    """As Anthropic's API has it (K3's own default is on)."""
    m = client.messages.create(model=MODEL, max_tokens=4, messages=ASK, **GREEDY)  # type: ignore[arg-type]
    off = client.messages.create(model=MODEL, max_tokens=4, messages=ASK, **OFF, **GREEDY)  # type: ignore[arg-type]
    assert m.content == off.content and prompt_tokens(m) == prompt_tokens(off)


def test_stop_sequence(client: anthropic.Anthropic) -> None:
    free = client.messages.create(model=MODEL, max_tokens=16, messages=ASK, **OFF, **GREEDY)  # type: ignore[arg-type]
    text = free.content[0].text  # type: ignore[union-attr]
    k = next(i for i in range(2, len(text) - 2) if text.find(text[i:i + 3]) == i and text[i:i + 3].strip())
    stop = text[k:k + 3]
    for m in (client.messages.create(model=MODEL, max_tokens=16, messages=ASK, stop_sequences=[stop, "zzqx"],  # type: ignore[arg-type]
                                     **OFF, **GREEDY),
              streamed(client, max_tokens=16, messages=ASK, stop_sequences=[stop, "zzqx"], **OFF, **GREEDY)[1]):
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
        assert m.content[0].text == text[:k]  # type: ignore[union-attr]


def test_thinking_block(server: Server, client: anthropic.Anthropic) -> None:
    # Random weights rarely close the think block within 16 tokens: the reply is all thinking so far.
    m = client.messages.create(model=MODEL, max_tokens=16, messages=ASK, **ON, **GREEDY)  # type: ignore[arg-type]
    assert [type(b) for b in m.content] == [ThinkingBlock] and m.content[0].thinking  # type: ignore[union-attr]
    c = chat(server, ASK, max_tokens=16, extra_body={"chat_template_kwargs": {"thinking": True}})
    assert m.content[0].thinking == c.choices[0].message.model_extra["reasoning_content"]  # type: ignore[union-attr]
    kinds, final = streamed(client, max_tokens=16, messages=ASK, **ON, **GREEDY)
    check_events(kinds)
    assert blocks(final) == blocks(m) and "thinking" in kinds
    # An earlier turn's thinking goes back as the chat's reasoning_content.
    history = [*ASK, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Oslo, then.",
                                                        "signature": ""}, {"type": "text", "text": "Cold."}]},
               {"role": "user", "content": "And Paris?"}]
    count = client.messages.count_tokens(model=MODEL, messages=history, **ON)  # type: ignore[arg-type]
    c = chat(server, [*ASK, {"role": "assistant", "content": "Cold.", "reasoning_content": "Oslo, then."},
                      {"role": "user", "content": "And Paris?"}], max_tokens=1,
             extra_body={"chat_template_kwargs": {"thinking": True}})
    assert count.input_tokens == c.usage.prompt_tokens


def test_tool_use_and_tool_result_round_trip(server: Server, client: anthropic.Anthropic) -> None:
    # A forced call (`any`), one only; room for the markup spelled out in characters, should the grammar backend
    # not pick the marker ids.
    ask = {"max_tokens": 400, "messages": ASK, "tools": TOOLS,
           "tool_choice": {"type": "any", "disable_parallel_tool_use": True}} | OFF | GREEDY
    m = client.messages.create(model=MODEL, **ask)  # type: ignore[arg-type]
    assert m.stop_reason == "tool_use" and [type(b) for b in m.content] == [ToolUseBlock], m
    call = m.content[0]
    assert isinstance(call, ToolUseBlock) and call.name == "get_weather" and isinstance(call.input, dict)
    assert call.id.startswith("functions.get_weather:")
    jsonschema.validate(call.input, WEATHER)
    kinds, final = streamed(client, **ask)  # the input assembled by the client from input_json_delta
    check_events(kinds)
    assert blocks(final) == blocks(m) and final.stop_reason == "tool_use" and "input_json" in kinds
    # The reply goes back as it came, with the tool's result; rendered as the chat route renders the same turn.
    turn = [*ASK, m.to_param(), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "sunny, 21 C"}],
         "is_error": False}]}]
    back = client.messages.create(model=MODEL, max_tokens=6, messages=turn, tools=TOOLS, **OFF, **GREEDY)  # type: ignore[arg-type]
    oai_call = {"id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": orjson.dumps(call.input).decode()}}
    c = chat(server, [*ASK, {"role": "assistant", "content": None, "tool_calls": [oai_call]},
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}],
             max_tokens=6, tools=OPENAI_TOOLS, extra_body={"chat_template_kwargs": {"thinking": False}})
    assert prompt_tokens(back) == c.usage.prompt_tokens
    assert (back.content[0].text if back.content else None) == c.choices[0].message.content  # type: ignore[union-attr]
    count = client.messages.count_tokens(model=MODEL, messages=turn, tools=TOOLS, **OFF)  # type: ignore[arg-type]
    assert count.input_tokens == c.usage.prompt_tokens


@pytest.mark.parametrize("body, status, kind, words", [
    ({"model": "nope"}, 404, "not_found_error", ("nope",)),
    ({"container": "c1"}, 400, "invalid_request_error", ("container",)),
    ({"thinking": {"type": "enabled", "budget_tokens": 10}}, 400, "invalid_request_error", ("budget_tokens",)),
    ({"output_config": {"effort": "medium"}}, 400, "invalid_request_error", ("output_config.effort",)),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     ("image", "not supported")),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error",
     ("web_search_20250305",)),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, 400, "invalid_request_error", ("nope",)),
    ({"messages": [*ASK, {"role": "assistant", "content": "Sure"}]}, 400, "invalid_request_error", ("prefill",)),
    ({"max_tokens": 0}, 400, "invalid_request_error", ("max_tokens",)),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "foo"}}}}, 400,
     "invalid_request_error", ("foo",)),
    ({"unknown_field": 1}, 400, "invalid_request_error", ("unknown_field",)),
])
def test_errors_in_anthropic_shape(server: Server, body: dict[str, Any], status: int, kind: str,
                                   words: tuple[str, ...]) -> None:
    with server.client() as h:
        r = h.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": ASK} | body)
    assert r.status_code == status, r.text
    got = r.json()
    assert got["type"] == "error" and got["error"]["type"] == kind and set(got["error"]) == {"type", "message"}
    assert all(w in got["error"]["message"] for w in words), got


def test_api_key(server: Server, client: anthropic.Anthropic) -> None:
    """`x-api-key` (the `anthropic` client's) and `Authorization: Bearer` open the server; none is a 401 in
    Anthropic's shape, which the client raises as its own error."""
    body = {"model": MODEL, "messages": ASK}
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        assert httpx.post(f"{server.url}/v1/messages/count_tokens", json=body, headers=headers).status_code == 200
    r = httpx.post(f"{server.url}/v1/messages/count_tokens", json=body, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.count_tokens(model=MODEL, messages=ASK)  # type: ignore[arg-type]
    assert e.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


def test_body_too_large(server: Server) -> None:
    """Refused by the access middleware, in Anthropic's shape as well."""
    big = [{"role": "user", "content": "x" * BODY_LIMIT}]
    with server.client() as h:
        r = h.post("/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": big})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text
    assert int(r.headers["content-length"]) == len(r.content)
