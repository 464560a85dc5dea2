"""Anthropic's Messages in terms of the chat route: a request becomes the `ChatCompletionRequest` of the same
conversation (so it renders, samples and parses exactly as `/v1/chat/completions` does), and the parsed reply
becomes Anthropic's content blocks, whole (`reply_blocks`) or as stream events (`BlockStream`).

The mapping: `system` is a system message; a user message's `tool_result` blocks are tool messages (in place,
its text blocks user messages between them); an assistant message's `thinking` blocks are its reasoning, its
`tool_use` blocks its tool calls (input as JSON arguments). `tool_choice` any is OpenAI's "required", tool is a
named choice, `disable_parallel_tool_use` is `parallel_tool_calls: false`. `thinking` turns K3's thinking on or
off; absent, it is off as Anthropic's API has it, where the chat format's default is on (K3's encoding); a
Jinja template keeps its own default. `output_config.effort` is K3's thinking effort, `output_config.format` a
JSON schema for the reply.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from pydantic import ValidationError

from runtime.http.anthropic_protocol import (
    CountTokensRequest,
    Message,
    MessagesRequest,
    StopReason,
    TextBlock,
    TextOut,
    ThinkingOut,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
)
from runtime.http.api_errors import validation_error
from runtime.http.openai_protocol import AssistantMessage, ChatCompletionRequest, DeltaMessage

log = logging.getLogger("uvicorn.error")


def chat_request(req: CountTokensRequest, thinking_default_on: bool) -> ChatCompletionRequest:
    """The chat completion request of the same conversation; `thinking_default_on`: the chat format thinks
    unless told not to (then an absent `thinking` says so)."""
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req)}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description is not None else {}),
            **({"strict": t.strict} if t.strict is not None else {})}} for t in req.tools]
    if (choice := req.tool_choice) is not None:
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
            "type": "function", "function": {"name": choice.name}}
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    kwargs: dict[str, Any] = {}
    if req.thinking is not None or thinking_default_on:
        kwargs["thinking"] = req.thinking is not None and req.thinking.on
    if req.output_config is not None and req.output_config.effort is not None:
        kwargs["thinking_effort"] = req.output_config.effort
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    if req.output_config is not None and req.output_config.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": req.output_config.format.schema_}}
    if isinstance(req, MessagesRequest):
        body |= {"max_tokens": req.max_tokens, "stop": req.stop_sequences, "temperature": req.temperature,
                 "top_p": req.top_p, "top_k": req.top_k}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:  # what Anthropic's schema lets through and OpenAI's does not
        raise validation_error(e) from None


def _messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if isinstance(req.system, str):
        out.append({"role": "system", "content": req.system})
    elif req.system:
        out.append({"role": "system", "content": _parts(req.system)})
    for m in req.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            out.append(_assistant(m))
        else:
            out += _user(m)
    return out


def _parts(blocks: list[TextBlock]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": b.text} for b in blocks]


def _user(m: Message) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[TextBlock] = []
    for b in m.content:
        if isinstance(b, ToolResultBlock):
            if texts:
                out.append({"role": "user", "content": _parts(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
        elif isinstance(b, TextBlock):
            texts.append(b)
    if texts:
        out.append({"role": "user", "content": _parts(texts)})
    return out


def _assistant(m: Message) -> dict[str, Any]:
    texts = [b for b in m.content if isinstance(b, TextBlock)]
    thinking = [b.thinking for b in m.content if b.type == "thinking"]  # type: ignore[union-attr]
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": orjson.dumps(b.input).decode()}}
             for b in m.content if isinstance(b, ToolUseBlock)]
    out: dict[str, Any] = {"role": "assistant", "content": _parts(texts) if texts else None if calls else ""}
    if thinking:
        out["reasoning_content"] = "".join(thinking)
    if calls:
        out["tool_calls"] = calls
    return out


# --- replies ------------------------------------------------------------------------------------------------


def tool_input(name: str, arguments: str) -> dict[str, Any]:
    """A call's arguments as Anthropic's `input`, which is an object: arguments that are not one (an untrained
    model may write anything) become `{}`, said in the log."""
    try:
        value = orjson.loads(arguments) if arguments.strip() else {}
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        log.warning("tool call %r: its arguments are not a JSON object, sent as {}: %.200r", name, arguments)
        return {}
    return value


Block = TextOut | ThinkingOut | ToolUseOut


def reply_blocks(message: AssistantMessage) -> list[Block]:
    blocks: list[Block] = []
    if message.reasoning_content:
        blocks.append(ThinkingOut(thinking=message.reasoning_content))
    if message.content:
        blocks.append(TextOut(text=message.content))
    for c in message.tool_calls or []:
        name = c.function.name or ""
        blocks.append(ToolUseOut(id=c.id, name=name, input=tool_input(name, c.function.arguments or "")))
    return blocks


def stop_reason(finish: str | None, matched: int | str | None, stop_sequences: list[str] | None
                ) -> tuple[StopReason, str | None]:
    """Anthropic's stop reason (and the stop sequence that ended the reply) from the chat's finish reason."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return "end_turn", None


class BlockStream:
    """The content block events of one streamed reply: `push` each delta of the chat's reply, then `finish`.
    A block opens when its first text comes and closes when another kind begins; a tool call's input is sent
    whole as the call's block closes (parsed as `reply_blocks` parses it), so what the client assembles is the
    non-streamed reply's blocks."""

    def __init__(self) -> None:
        self._index = -1
        self._kind: str | None = None
        self._call: tuple[str, list[str]] | None = None  # the open tool_use block's name and argument fragments

    def push(self, delta: DeltaMessage) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning_content:
            events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning_content}))
        if delta.content:
            events += self._open("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for t in delta.tool_calls or []:
            if t.function.name is not None:  # a new call
                events += self._close()
                events += self._open("tool_use", {"type": "tool_use", "id": t.id, "name": t.function.name,
                                                  "input": {}})
                self._call = (t.function.name, [])
            if self._call is not None:
                self._call[1].append(t.function.arguments or "")
        return events

    def finish(self) -> list[dict[str, Any]]:
        return self._close()

    def _open(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        if self._kind == kind and kind != "tool_use":
            return []
        events = self._close()
        self._index += 1
        self._kind = kind
        return [*events, {"type": "content_block_start", "index": self._index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._index, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if self._kind is None:
            return []
        events = []
        if self._call is not None:
            name, fragments = self._call
            partial = orjson.dumps(tool_input(name, "".join(fragments))).decode()
            events.append(self._delta({"type": "input_json_delta", "partial_json": partial}))
            self._call = None
        self._kind = None
        return [*events, {"type": "content_block_stop", "index": self._index}]
