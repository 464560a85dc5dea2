"""A Responses request as the chat it is: its input items (after the stored conversation of
`previous_response_id`) become chat messages, its options the chat route's fields, so that /v1/responses renders,
samples and parses exactly as /v1/chat/completions does (`runtime.http.openai_api.plan_chat`).

An assistant turn is one chat message however many items the API spreads it over: its reasoning, its text and its
function calls, in that order; a function call's output is a tool message answering its `call_id`. Developer
messages are system messages. Errors the chat route finds are told in the Responses API's names for its fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import TypeAdapter, ValidationError

from runtime.http.api_errors import APIError, validation_error
from runtime.http.openai_protocol import ChatCompletionRequest
from runtime.http.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    NamedFunction,
    OutputItem,
    ReasoningItem,
    ResponsesRequest,
)

Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEMS: TypeAdapter[list[Any]] = TypeAdapter(list[InputItem])

# The chat route's names of the Responses API's fields (and the engine's, for the sampling parameters' checks).
_RESPONSES_NAMES = {"messages": "input", "reasoning_effort": "reasoning.effort", "max_tokens": "max_output_tokens",
                    "max_new_tokens": "max_output_tokens", "response_format": "text.format", "rid": "request_id",
                    "json_schema": "text.format", "prompt": "input"}


def in_responses_terms(e: APIError) -> APIError:
    """A chat-side error with the field it names as the Responses API names it (a chat message's index is not an
    input item's: a message's error names the input)."""
    if e.param is None:
        return e
    head = e.param.split(".", 1)[0].split("[", 1)[0]
    if head not in _RESPONSES_NAMES:
        return e
    param = _RESPONSES_NAMES[head] if head in ("messages", "prompt") else _RESPONSES_NAMES[head] + e.param[len(head):]
    message = param + e.message[len(e.param):] if e.message.startswith(e.param) else e.message
    return APIError(e.status, message, e.type, param, e.code)


def chat_messages(items: Sequence[Item]) -> list[dict[str, Any]]:
    """Input items as chat messages: the items of one assistant turn (reasoning, text, calls) join in one."""
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None

    def close_turn() -> None:
        nonlocal turn
        if turn is not None:
            if turn["content"] is None and not turn.get("tool_calls"):
                turn["content"] = ""  # a turn that only thought (cut short)
            out.append(turn)
        turn = None

    for item in items:
        if isinstance(item, ReasoningItem):
            if turn is not None and (turn["content"] is not None or turn.get("tool_calls")):
                close_turn()  # reasoning opens a turn
            turn = turn or {"role": "assistant", "content": None}
            turn["reasoning_content"] = turn.get("reasoning_content", "") + item.text()
        elif isinstance(item, MessageItem) and item.role == "assistant":
            if turn is not None and turn.get("tool_calls"):
                close_turn()  # text after calls is the next turn's
            turn = turn or {"role": "assistant", "content": None}
            turn["content"] = (turn["content"] or "") + item.text()
        elif isinstance(item, FunctionCallItem):
            turn = turn or {"role": "assistant", "content": None}
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            close_turn()
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()}
                       | ({"name": item.name} if item.name else {}))
        else:
            close_turn()
            out.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
    close_turn()
    return out


def output_messages(output: Sequence[OutputItem]) -> list[dict[str, Any]]:
    """A response's output as the chat messages it adds to its conversation: read back as input items, as a client
    that sends them again would send them."""
    return chat_messages(_ITEMS.validate_python([item.model_dump() for item in output]))


def chat_request(req: ResponsesRequest, conversation: Sequence[dict[str, Any]]) -> tuple[ChatCompletionRequest,
                                                                                          list[dict[str, Any]]]:
    """The chat request of `req` after `conversation` (the stored chat messages of its previous response), and
    the input's own messages (which the conversation keeps; the instructions it does not, as in the API)."""
    added = chat_messages(req.input_items())
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    choice: Any = req.tool_choice
    if isinstance(choice, NamedFunction):
        choice = {"type": "function", "function": {"name": choice.name}}
    text_format = req.text.format if req.text is not None else None
    effort = req.reasoning.effort if req.reasoning is not None else None
    body: dict[str, Any] = {
        "model": req.model, "messages": [*system, *conversation, *added],
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                  for t in req.tools] if req.tools else None,
        "tool_choice": choice, "parallel_tool_calls": req.parallel_tool_calls,
        "reasoning_effort": effort, "chat_template_kwargs": req.chat_template_kwargs,
        "response_format": text_format.response_format() if text_format is not None else None,
        "max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "top_k": req.top_k, "min_p": req.min_p, "repetition_penalty": req.repetition_penalty,
        "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
        "stop": req.stop, "seed": req.seed, "rid": req.request_id,
    }
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise in_responses_terms(validation_error(e)) from None
    return chat, added
