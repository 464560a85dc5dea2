"""The OpenAI Responses API (/v1/responses) through the real server on the built-in model, read by the real `openai`
client: the typed objects it returns, every event sequence its stream readers parse, function calls and their
outputs round-tripped through `previous_response_id` and through explicit input items, and greedy replies equal
to what /v1/chat/completions gives for the same conversation."""

from __future__ import annotations

from typing import Any

import httpx
import jsonschema
import openai
import orjson
import pytest
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseReasoningItem,
)

from tests.runtime.http_server_proc import Server

MODEL = "k3-tiny"
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": CITY,
          "strict": True}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                 "parameters": CITY, "strict": True}}]
ASK = "What is the weather in Oslo?"
# Thinking is on by default, and an untrained model does not end its reasoning: tests of calls and text turn it off.
NO_THINKING = {"reasoning": {"effort": "none"}}
FORCED = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 400}


@pytest.fixture(scope="module")
def server(default_server: Server) -> Server:
    return default_server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    # Generous: a loaded 2-core CI machine decodes slowly; this bounds a hang, it times nothing.
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=300.0)


@pytest.fixture(scope="module")
def forced_call(client: openai.OpenAI) -> Any:
    """A reply that calls get_weather (forced), thinking off, greedy."""
    return client.responses.create(model=MODEL, input=ASK, temperature=0, **NO_THINKING, **FORCED)  # type: ignore[arg-type]


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)  # type: ignore[arg-type]


def items(response: Any) -> list[dict[str, Any]]:
    """The output items without their ids (fresh in every response)."""
    return [o.model_dump(exclude={"id"}) for o in response.output]


def test_text_equals_chat_completions(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, instructions="Be brief.", input=ASK, max_output_tokens=8,
                                temperature=0, **NO_THINKING)  # type: ignore[arg-type]
    c = chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}], max_tokens=8,
             reasoning_effort="none")
    assert [type(o) for o in r.output] == [ResponseOutputMessage]
    assert r.output_text == c.choices[0].message.content and r.output_text
    assert c.choices[0].finish_reason == "length"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.instructions == "Be brief."
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_thinking_is_a_reasoning_item(client: openai.OpenAI) -> None:
    """K3's thinking (on by default) comes back as a reasoning item whose content is the chat's reasoning_content;
    all of the cut reply is reasoning."""
    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=8, temperature=0)
    c = chat(client, [{"role": "user", "content": ASK}], max_tokens=8)
    assert [type(o) for o in r.output] == [ResponseReasoningItem]
    reasoning = c.choices[0].message.model_extra["reasoning_content"]
    assert [p.text for p in r.output[0].content] == [reasoning] and r.output[0].summary == []
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 8


def test_sealed_reasoning_goes_back_as_input(client: openai.OpenAI) -> None:
    """Without storing (as Codex runs): the thinking sent back only in `encrypted_content` is the earlier turn's
    reasoning, as the chat route renders an assistant message's reasoning_content."""
    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=4, temperature=0, store=False,
                                include=["reasoning.encrypted_content"])
    (item,) = r.output
    assert isinstance(item, ResponseReasoningItem) and item.encrypted_content
    sealed = {"type": "reasoning", "id": item.id, "summary": [], "encrypted_content": item.encrypted_content}
    again = client.responses.create(model=MODEL, input=[{"role": "user", "content": ASK}, sealed,  # type: ignore[list-item]
                                                        {"role": "user", "content": "Go on."}], max_output_tokens=1)
    c = chat(client, [{"role": "user", "content": ASK},
                      {"role": "assistant", "content": "", "reasoning_content": item.content[0].text},
                      {"role": "user", "content": "Go on."}], max_tokens=1)
    assert again.usage.input_tokens == c.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="another server"):
        client.responses.create(model=MODEL, input=[sealed | {"encrypted_content": "gAAAAB"}], max_output_tokens=1)


def check_events(events: list[Any]) -> None:
    """The lifecycle as the API sends it: created, in progress, each item added then done, the end last."""
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert added == done == list(range(len(events[-1].response.output)))


@pytest.mark.parametrize("kw", [NO_THINKING, {}], ids=["text", "thinking"])
def test_stream_rebuilds_the_response(client: openai.OpenAI, kw: dict[str, Any]) -> None:
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 8, "temperature": 0, **kw}
    whole = client.responses.create(**body)
    events = list(client.responses.create(**body, stream=True))
    check_events(events)
    final = events[-1].response
    assert items(final) == items(whole) and final.status == whole.status == "incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == whole.output_text
    assert reasoning == "".join(p.text for o in whole.output if o.type == "reasoning" for p in o.content or [])
    assert text or reasoning
    assert final.usage.model_dump(exclude={"input_tokens_details"}) == whole.usage.model_dump(
        exclude={"input_tokens_details"})  # the second prompt is cached


def test_a_codex_shaped_request_on_the_wire(server: Server) -> None:
    """What Codex sends (stateless: no store, reasoning sealed; a developer message; function tools not strict;
    a cache key), and the stream as it reads it: each event a `event: TYPE` line and its JSON, no [DONE]."""
    tool = TOOLS[0] | {"strict": False}
    body = {"model": MODEL, "instructions": "You are a coding agent.", "stream": True, "store": False,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "session-1", "tools": [tool],
            "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "high", "summary": "auto"},
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "env"}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]}],
            "max_output_tokens": 3,
            "temperature": 0}  # greedy: a random model's sampled tokens may end the thinking within the 3 (flaky)
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=300.0) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = r.read().decode().strip().split("\n\n")
    events = []
    for frame in frames:
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append(orjson.loads(data[6:]))
        assert events[-1]["type"] == name[7:]
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["store"] is False
    (item,) = events[-1]["response"]["output"]
    assert item["type"] == "reasoning" and item["encrypted_content"]


def test_an_aborted_stream_is_cancelled(client: openai.OpenAI, server: Server) -> None:
    """`request_id` (SGLang's extra) names the request for /abort_request: the stream ends, cancelled."""
    events = []
    with client.responses.create(model=MODEL, input=ASK, max_output_tokens=300, temperature=0, stream=True,
                                 extra_body={"request_id": "resp-to-abort"}, **NO_THINKING) as stream:  # type: ignore[arg-type]
        for e in stream:
            events.append(e)
            if e.type == "response.output_text.delta" and len(events) == 5:
                assert httpx.post(f"{server.url}/abort_request", json={"rid": "resp-to-abort"}).status_code == 200
    check_events(events)
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.status == "cancelled"
    assert final.usage.output_tokens < 300 and final.output[0].status == "incomplete"


def test_forced_function_call(client: openai.OpenAI, forced_call: Any) -> None:
    r = forced_call
    assert r.status == "completed" and [type(o) for o in r.output] == [ResponseFunctionToolCall]
    call = r.output[0]
    assert call.name == "get_weather" and call.status == "completed" and call.call_id
    jsonschema.validate(orjson.loads(call.arguments), CITY)
    assert r.tools[0].name == "get_weather" and r.tool_choice == "required"


def test_responses_stream_parses_a_function_call(client: openai.OpenAI, forced_call: Any) -> None:
    """The client's own stream reader (`responses.stream`) to its final, parsed response."""
    with client.responses.stream(model=MODEL, input=ASK, temperature=0, **NO_THINKING, **FORCED) as stream:  # type: ignore[arg-type]
        events = list(stream)
        final = stream.get_final_response()
    check_events(events)
    assert items(final)[0] | {"parsed_arguments": None} == items(forced_call)[0] | {"parsed_arguments": None}
    assert isinstance(final.output[0], ResponseFunctionToolCall)
    assert final.output[0].parsed_arguments == orjson.loads(forced_call.output[0].arguments)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == forced_call.output[0].arguments


def tool_turn(forced_call: Any) -> list[dict[str, Any]]:
    """The chat of the forced call answered: the user's question, the call, its output."""
    call = forced_call.output[0]
    return [{"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]


def test_tool_output_through_previous_response_id(client: openai.OpenAI, forced_call: Any) -> None:
    output = {"type": "function_call_output", "call_id": forced_call.output[0].call_id, "output": "sunny, 21 C"}
    r = client.responses.create(model=MODEL, previous_response_id=forced_call.id, input=[output], tools=TOOLS,
                                max_output_tokens=6, temperature=0, **NO_THINKING)  # type: ignore[arg-type, list-item]
    c = chat(client, tool_turn(forced_call), tools=CHAT_TOOLS, max_tokens=6, reasoning_effort="none")
    assert r.previous_response_id == forced_call.id
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.output_text == (c.choices[0].message.content or "")


def test_tool_output_through_input_items(client: openai.OpenAI, forced_call: Any) -> None:
    """The whole conversation sent again, the earlier output items as the client returned them, and the
    instructions of this turn only."""
    output = {"type": "function_call_output", "call_id": forced_call.output[0].call_id, "output": "sunny, 21 C"}
    conversation = [{"role": "user", "content": [{"type": "input_text", "text": ASK}]}, *forced_call.output, output]
    r = client.responses.create(model=MODEL, instructions="Answer in French.", input=conversation,  # type: ignore[arg-type]
                                tools=TOOLS, max_output_tokens=6, temperature=0, **NO_THINKING)  # type: ignore[arg-type]
    c = chat(client, [{"role": "system", "content": "Answer in French."}, *tool_turn(forced_call)], tools=CHAT_TOOLS,
             max_tokens=6, reasoning_effort="none")
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.output_text == (c.choices[0].message.content or "")


def test_conversation_keeps_replies_not_instructions(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, instructions="Be brief.", input="Hi", max_output_tokens=4,
                                    temperature=0, **NO_THINKING)  # type: ignore[arg-type]
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="And then?",
                                     max_output_tokens=4, temperature=0, **NO_THINKING)  # type: ignore[arg-type]
    c = chat(client, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
                      {"role": "user", "content": "And then?"}], max_tokens=4, reasoning_effort="none")
    assert second.usage.input_tokens == c.usage.prompt_tokens
    assert second.output_text == c.choices[0].message.content
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_json_schema_text_format(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=12, temperature=0, **NO_THINKING,  # type: ignore[arg-type]
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    c = chat(client, [{"role": "user", "content": ASK}], max_tokens=12, reasoning_effort="none",
             response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert r.output_text == c.choices[0].message.content
    assert r.text.format.type == "json_schema"


def test_store_false_and_unknown_ids(client: openai.OpenAI, server: Server) -> None:
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=False, **NO_THINKING)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=r.id, max_output_tokens=1)
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    kept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, **NO_THINKING)  # type: ignore[arg-type]
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


@pytest.mark.parametrize("extra, param, words", [
    ({"background": True}, "background", ("does not support background",)),
    ({"include": ["message.output_text.logprobs"]}, "include[0]", ("reasoning.encrypted_content",)),
    ({"truncation": "auto"}, "truncation", ("does not support truncation",)),
    ({"conversation": "conv_1"}, "conversation", ("does not support conversation",)),
    ({"text": {"verbosity": "high"}}, "text.verbosity", ()),
    ({"tools": [{"type": "web_search"}]}, "tools", ("function only", "web_search")),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", ("function_call_output",)),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     ("input_image",)),
    ({"reasoning": {"effort": "xhigh"}}, "reasoning.effort", ("'low'", "'max'")),
    ({"reasoning": {"effort": "medium"}}, "reasoning.effort", ("reasoning.effort: ", "low, high, max")),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, None, ("tool_choice", "not in tools")),
    ({"input": [{"type": "function_call_output", "call_id": "x", "output": "r"}]}, "input", ("no tool name",)),
    ({"max_output_tokens": -1}, "max_output_tokens", ()),
    ({"max_output_tokens": 10**8}, "max_output_tokens", ("capacity",)),
    ({"nonsense": 1}, "nonsense", ("unknown field",)),
])
def test_refusals_name_the_field(server: Server, extra: dict[str, Any], param: str | None, words: tuple[str, ...]
                                 ) -> None:
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 2} | extra
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60.0)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert all(w in error["message"] for w in words), error


def test_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-nope", input="Hi")
    assert e.value.body["code"] == "model_not_found"
