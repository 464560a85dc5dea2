"""Anthropic's Messages as the chat route's requests and replies (`runtime.http.anthropic_chat`), without a
server: the conversation mapping, the stop reasons, and the content block events of a streamed reply."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.http.anthropic_chat import BlockStream, chat_request, reply_blocks, stop_reason
from runtime.http.anthropic_protocol import CountTokensRequest, MessagesRequest
from runtime.http.openai_protocol import (
    AssistantMessage,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)

TOOL = {"name": "f", "description": "does f", "input_schema": {"type": "object", "properties": {"x": {}}}}


def request(**kw: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 5, **kw})


def test_conversation_maps_to_the_same_chat() -> None:
    req = request(
        system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "let me"},
                                              {"type": "tool_use", "id": "c1", "name": "f", "input": {"x": 1}},
                                              {"type": "tool_use", "id": "c2", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c2", "content": "two"},
                                         {"type": "tool_result", "tool_use_id": "c1",
                                          "content": [{"type": "text", "text": "one"}], "is_error": True},
                                         {"type": "text", "text": "now?"}]},
        ],
        tools=[TOOL], tool_choice={"type": "tool", "name": "f", "disable_parallel_tool_use": True},
        stop_sequences=["END"], temperature=0.5, top_k=3, thinking={"type": "enabled", "budget_tokens": 2048},
        output_config={"effort": "low"})
    chat = chat_request(req, thinking_default_on=True)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "text", "text": "let me"}], "reasoning_content": "hm",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}},
                        {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "user", "content": [{"type": "text", "text": "now?"}]},
    ]
    assert [t.model_dump(exclude_none=True) for t in chat.tools or []] == [
        {"type": "function", "function": {"name": "f", "description": "does f", "parameters": TOOL["input_schema"]}}]
    assert chat.tool_choice is not None and chat.tool_choice.model_dump() == {"type": "function",
                                                                              "function": {"name": "f"}}
    assert not chat.parallel_tool_calls
    assert chat.chat_template_kwargs == {"thinking": True, "thinking_effort": "low"}
    assert chat.sampling(chat.max_new_tokens) == {"n": 1, "temperature": 0.5, "top_k": 3, "max_new_tokens": 5,
                                                  "stop": ["END"]}


@pytest.mark.parametrize("thinking, default_on, kwargs", [
    (None, True, {"thinking": False}),  # Anthropic's default (off) said where the format's is on
    (None, False, None),  # a template keeps its own
    ({"type": "disabled"}, False, {"thinking": False}),
    ({"type": "adaptive"}, True, {"thinking": True}),
])
def test_thinking(thinking: dict[str, Any] | None, default_on: bool, kwargs: dict[str, Any] | None) -> None:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    if thinking is not None:
        body["thinking"] = thinking
    assert chat_request(CountTokensRequest.model_validate(body), default_on).chat_template_kwargs == kwargs


@pytest.mark.parametrize("choice, openai", [({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
                                            ({"type": "none"}, "none")])
def test_tool_choice(choice: dict[str, Any], openai: str) -> None:
    chat = chat_request(request(messages=[{"role": "user", "content": "q"}], tools=[TOOL], tool_choice=choice), False)
    assert chat.tool_choice == openai and chat.parallel_tool_calls


def test_stop_reasons() -> None:
    assert stop_reason("tool_calls", 7, None) == ("tool_use", None)
    assert stop_reason("length", None, ["x"]) == ("max_tokens", None)
    assert stop_reason("stop", "x", ["x"]) == ("stop_sequence", "x")
    assert stop_reason("stop", 7, ["x"]) == ("end_turn", None)  # the end-of-message token


def call(index: int, name: str | None, arguments: str, cid: str | None = None) -> DeltaToolCall:
    return DeltaToolCall(index=index, id=cid, type="function" if name else None,
                         function=FunctionCallOut(name=name, arguments=arguments))


def test_block_stream_events_add_up_to_the_whole_reply() -> None:
    deltas = [DeltaMessage(reasoning_content="thin"), DeltaMessage(reasoning_content="k"),
              DeltaMessage(content="hi"), DeltaMessage(content=""),
              DeltaMessage(tool_calls=[call(0, "f", '{"x":', "c0")]), DeltaMessage(tool_calls=[call(0, None, "1}")]),
              DeltaMessage(tool_calls=[call(1, "f", "not json", "c1")])]
    stream = BlockStream()
    events = [e for d in deltas for e in stream.push(d)] + stream.finish()
    assert [(e["type"], e["index"], e.get("delta", e.get("content_block"))) for e in events] == [
        ("content_block_start", 0, {"type": "thinking", "thinking": "", "signature": ""}),
        ("content_block_delta", 0, {"type": "thinking_delta", "thinking": "thin"}),
        ("content_block_delta", 0, {"type": "thinking_delta", "thinking": "k"}),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, {"type": "text", "text": ""}),
        ("content_block_delta", 1, {"type": "text_delta", "text": "hi"}),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, {"type": "tool_use", "id": "c0", "name": "f", "input": {}}),
        ("content_block_delta", 2, {"type": "input_json_delta", "partial_json": '{"x":1}'}),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, {"type": "tool_use", "id": "c1", "name": "f", "input": {}}),
        ("content_block_delta", 3, {"type": "input_json_delta", "partial_json": "{}"}),  # as reply_blocks has it
        ("content_block_stop", 3, None),
    ]
    whole = AssistantMessage(content="hi", reasoning_content="think", tool_calls=[
        ToolCallOut(id="c0", function=FunctionCallOut(name="f", arguments='{"x":1}')),
        ToolCallOut(id="c1", function=FunctionCallOut(name="f", arguments="not json"))])
    assert [b.model_dump() for b in reply_blocks(whole)] == [
        {"type": "thinking", "thinking": "think", "signature": ""}, {"type": "text", "text": "hi"},
        {"type": "tool_use", "id": "c0", "name": "f", "input": {"x": 1}},
        {"type": "tool_use", "id": "c1", "name": "f", "input": {}}]


@pytest.mark.parametrize("body, words", [
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "'document'"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]}, "tool_result"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]},
     "tool_use"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "server tools"),
    ({"tool_choice": {"type": "any"}}, "needs tools"),
    ({"thinking": {"type": "disabled", "budget_tokens": 2000}}, "budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2000, "display": "omitted"}}, "display"),
    ({"messages": [{"role": "user", "content": []}]}, "content"),
    ({"mcp_servers": [{"type": "url", "url": "x", "name": "y"}]}, "mcp_servers"),
])
def test_refused_by_name(body: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        request(**({"messages": [{"role": "user", "content": "q"}]} | body))
