"""The OpenAI chat route's K3 side: a request with tools or thinking becomes a K3 prompt (and, when a call
is forced, a grammar); the engine's text (special tokens kept) goes through the reply assembler
(`runtime.tokenizer.k3_reply`), whose replies and deltas this maps to OpenAI's message fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from radixk3.tokenizer import Tokenizer
from runtime.errors import InvalidRequest
from runtime.grammar_compile import error_message
from runtime.grammar_schema import vet_json_schema
from runtime.http.api_errors import APIError
from runtime.http.openai_protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    NamedToolChoice,
    ToolCallOut,
)
from runtime.tokenizer.k3_reply import ReplyAssembler, without_stop_text
from runtime.tokenizer.k3_tools import K3Prompt, RenderError, forcing_grammar, render_k3_chat

_GRAMMAR_FIELDS = ("regex", "ebnf", "json_schema")


@dataclass(frozen=True)
class K3Chat:
    prompt: K3Prompt
    parse_tools: bool
    grammar: str | None  # EBNF forcing a tool call
    parallel_calls: bool  # OpenAI's parallel_tool_calls: off, a reply keeps its first call only


def plan_k3_chat(req: ChatCompletionRequest, max_grammar_bytes: int) -> K3Chat:
    """The K3 prompt, and the grammar when a call is forced. The grammar is built from the tools' parameter
    schemas, which are held to what a request's own json_schema is held to (depth, supported features, and the
    grammar's size, `--max-grammar-bytes`). It may take a while for large schemas: call it off the event loop."""
    if (problem := req.k3_template_kwargs_problem()) is not None:
        raise APIError(400, problem, "invalid_request_error", param="chat_template_kwargs")
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] if req.tools_on else []
    choice = req.tool_choice
    forced: str | dict[str, Any] | None = None  # as xgrammar takes tool_choice
    forced_name: str | None = None  # as the renderer records it
    if tools and isinstance(choice, NamedToolChoice):
        forced, forced_name = choice.model_dump(), choice.function.name
    elif tools and choice == "required":
        forced = forced_name = "required"
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    if forced is not None:
        for i, tool in enumerate(tools):
            field = f"tools[{i}].function.parameters"
            try:
                vet_json_schema(orjson.dumps(tool.get("function", {}).get("parameters", {})).decode())
            except InvalidRequest as e:
                raise APIError(400, e.message.replace("json_schema", field, 1), param=field) from None
    try:
        prompt = render_k3_chat(messages, tools, req.thinking, forced_name)
        grammar = None if forced is None else forcing_grammar(tools, forced, req.thinking, req.parallel_tool_calls)
    except RenderError as e:
        raise APIError(400, str(e), "invalid_request_error", param="messages") from None
    except (ValueError, RuntimeError) as e:  # xgrammar refusing a tool's parameter schema
        raise APIError(400, f"tools: {error_message(e)}", "invalid_request_error", param="tools") from None
    if grammar is not None and (size := len(grammar.encode())) > max_grammar_bytes:
        raise APIError(400, f"tools: the grammar that forces the tool call is {size} bytes, over the limit of "
                       f"{max_grammar_bytes} bytes (--max-grammar-bytes)", param="tools")
    return K3Chat(prompt, bool(tools), grammar, req.parallel_tool_calls)


def k3_sampling(chat: K3Chat, sampling: dict[str, Any]) -> dict[str, Any]:
    """The parser reads the markup, so special tokens stay in the text; a forced call brings its grammar."""
    out = dict(sampling, skip_special_tokens=False)
    if chat.grammar is not None:
        if any(k in out for k in _GRAMMAR_FIELDS):
            raise APIError(400, "a forced tool call (tool_choice 'required' or named) cannot be combined with"
                           " response_format, regex or ebnf", "invalid_request_error", param="tool_choice")
        out["ebnf"] = chat.grammar
    return out


class K3Reply:
    """One choice: `push` each chunk of the engine's text (the stop token's own text is dropped at the end)."""

    def __init__(self, chat: K3Chat, tokenizer: Tokenizer) -> None:
        self._reply = ReplyAssembler(chat.prompt.prefix, tools=chat.parse_tools, forced=chat.grammar is not None,
                                     parallel=chat.parallel_calls)
        self._tok = tokenizer

    def push(self, text: str, finished: str | None, last_ids: list[int]) -> DeltaMessage:
        if finished is not None:
            text = without_stop_text(self._tok, text, last_ids)
        d = self._reply.push(text, final=finished is not None)
        calls = [DeltaToolCall(index=c.index, id=c.id, type="function" if c.name is not None else None,
                               function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in d.tool_calls]
        return DeltaMessage(content=d.content or None, reasoning_content=d.reasoning or None,
                            tool_calls=calls or None)

    def message(self) -> AssistantMessage:
        r = self._reply.reply()
        calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                 for c in r.tool_calls]
        return AssistantMessage(content=r.content, reasoning_content=r.reasoning_content, tool_calls=calls or None)

    def finish_reason(self, finished: str | None) -> str | None:
        return self._reply.finish_reason(finished)


def k3_message(chat: K3Chat, tokenizer: Tokenizer, text: str, finished: str | None, ids: list[int]
               ) -> tuple[AssistantMessage, str | None]:
    reply = K3Reply(chat, tokenizer)
    reply.push(text, finished or "length", ids)
    return reply.message(), reply.finish_reason(finished)
