"""The Responses API's pieces without a server: input items as the chat they are, output items read back as
input, the stream events of a reply, the sealed reasoning, and the store's bounds."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.http.api_errors import APIError
from runtime.http.openai_protocol import DeltaMessage, DeltaToolCall, FunctionCallOut
from runtime.http.responses_chat import chat_messages, chat_request, in_responses_terms, output_messages
from runtime.http.responses_output import OutputBuilder
from runtime.http.responses_protocol import ResponsesRequest, open_reasoning, seal_reasoning
from runtime.http.responses_store import ResponseStore, stored

CALL = {"type": "function_call", "call_id": "functions.f:0", "name": "f", "arguments": "{}"}


def request(**kw: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m"} | kw)


def test_one_assistant_turn_from_its_items() -> None:
    req = request(input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        CALL, CALL | {"call_id": "functions.f:1"},
        {"type": "function_call_output", "call_id": "functions.f:0", "output": "r0"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "then"}]},
        CALL | {"call_id": "functions.f:2"},
    ])
    calls = [{"id": f"functions.f:{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
             for i in range(3)]
    assert chat_messages(req.input_items()) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "ok", "reasoning_content": "hmm", "tool_calls": calls[:2]},
        {"role": "tool", "tool_call_id": "functions.f:0", "content": "r0"},
        {"role": "assistant", "content": None, "reasoning_content": "then", "tool_calls": calls[2:]},
    ]


def test_a_turn_that_only_thought_has_empty_content() -> None:
    req = request(input=[{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]}])
    assert chat_messages(req.input_items()) == [{"role": "assistant", "content": "", "reasoning_content": "x"}]


def test_instructions_first_then_the_conversation() -> None:
    history = [{"role": "user", "content": "before"}, {"role": "assistant", "content": "reply"}]
    chat, added = chat_request(request(input="now", instructions="sys", max_output_tokens=3), history)
    assert [(m.role, m.content) for m in chat.messages] == [("system", "sys"), ("user", "before"),
                                                            ("assistant", "reply"), ("user", "now")]
    assert added == [{"role": "user", "content": "now"}] and chat.max_tokens == 3


def test_the_stream_events_and_the_items_agree() -> None:
    out = OutputBuilder(seal_reasoning=True)
    deltas = [DeltaMessage(reasoning_content="th"), DeltaMessage(reasoning_content="ink"), DeltaMessage(content="hi"),
              DeltaMessage(tool_calls=[DeltaToolCall(index=0, id="functions.f:0", type="function",
                                                     function=FunctionCallOut(name="f", arguments='{"a":'))]),
              DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=FunctionCallOut(arguments="1}"))])]
    events = [e for d in deltas for e in out.push(d)] + out.finish(complete=True)
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == [i.model_dump() for i in out.items] and all(i["status"] == "completed" for i in done)
    reasoning, message, call = out.items
    assert reasoning.content[0].text == "think" and open_reasoning(reasoning.encrypted_content or "") == "think"
    assert message.content[0].text == "hi" and (call.call_id, call.arguments) == ("functions.f:0", '{"a":1}')
    assert output_messages(out.items) == [{"role": "assistant", "content": "hi", "reasoning_content": "think",
                                           "tool_calls": [{"id": "functions.f:0", "type": "function",
                                                           "function": {"name": "f", "arguments": '{"a":1}'}}]}]


def test_a_cut_reply_leaves_its_last_item_incomplete() -> None:
    out = OutputBuilder()
    out.push(DeltaMessage(content="partial"))
    assert out.finish(complete=False)[-1]["item"]["status"] == "incomplete"


@pytest.mark.parametrize("sealed", ["gAAAAABnot-ours", "radixk3-reasoning:%%%"])
def test_foreign_or_damaged_reasoning_is_refused(sealed: str) -> None:
    with pytest.raises(ValueError, match="encrypted_content"):
        request(input=[{"type": "reasoning", "summary": [], "encrypted_content": sealed}])
    assert open_reasoning(seal_reasoning("ünï")) == "ünï"


def test_chat_errors_in_the_responses_names() -> None:
    e = in_responses_terms(APIError(400, "max_new_tokens must be positive", param="max_new_tokens"))
    assert (e.param, e.message) == ("max_output_tokens", "max_output_tokens must be positive")
    assert in_responses_terms(APIError(400, "messages[3].content: bad", param="messages[3].content")).param == "input"
    assert in_responses_terms(APIError(400, "temperature: bad", param="temperature")).param == "temperature"


def test_the_store_keeps_the_latest_within_its_bounds() -> None:
    store = ResponseStore(max_responses=2, max_chars=10_000)
    for rid in ("a", "b", "c"):
        store.put(rid, stored({"id": rid}, []))
    assert store.get("a") is None and store.get("b") is not None and len(store) == 2
    store.put("d", stored({"id": "d"}, []))  # "b" was read last: "c" goes
    assert store.get("c") is None and store.get("b") is not None
    store.put("big", stored({"id": "big"}, [{"role": "user", "content": "x" * 20_000}]))
    assert store.get("big") is None and len(store) == 2  # larger than the whole store: not kept
    most = stored({"id": "most"}, [{"role": "user", "content": "x" * 9_950}])
    assert most.chars + stored({"id": "b"}, []).chars > store.max_chars >= most.chars
    store.put("most", most)
    assert len(store) == 1 and store.get("most") is not None  # the others went to make room
    assert store.delete("most") and not store.delete("most")
