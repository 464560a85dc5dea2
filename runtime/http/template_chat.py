"""The OpenAI chat route's side for a checkpoint's own Jinja chat template (`runtime.tokenizer.chat_format`):
the request's messages, tools and `chat_template_kwargs` rendered by the template, a forced call's grammar
(`runtime.tokenizer.kimi_k2_grammar`), and the reply read back by the template family's parsers (`kimi_k2` tool
calls, an optional `<think>` reasoning parser) into OpenAI's fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from radixk3.chat_prompt import ChatPrompt
from radixk3.chat_template import ChatTemplateError, hf_chat_ids
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
from runtime.tokenizer.chat_format import ChatFormat
from runtime.tokenizer.k3_reply import without_stop_text
from runtime.tokenizer.kimi_k2_grammar import kimi_k2_forcing_grammar
from runtime.tokenizer.kimi_k2_parser import KimiK2Reply

_GRAMMAR_FIELDS = ("regex", "ebnf", "json_schema")


@dataclass(frozen=True)
class TemplateChat:
    prompt: ChatPrompt | list[int]  # rendered by radixk3, or ids from the transformers tokenizer's own template
    tools: bool  # the reply is parsed for tool calls
    reasoning: str | None  # the reasoning parser, if any
    parallel_calls: bool
    grammar: str | None = None  # EBNF forcing a tool call

    @property
    def parses(self) -> bool:
        return self.tools or self.reasoning is not None

    def ids(self, tokenizer: Tokenizer) -> list[int]:
        """The prompt's ids; no bos of radixk3's own: a template writes its bos if it wants one."""
        return list(self.prompt) if isinstance(self.prompt, list) else self.prompt.ids(tokenizer, add_bos=False)


def plan_template_chat(req: ChatCompletionRequest, fmt: ChatFormat, max_grammar_bytes: int) -> TemplateChat:
    """The rendered prompt, and the grammar when a call is forced (tool_choice "required" or named: built from the
    tools' parameter schemas, held to what a request's own json_schema is held to; it may take a while for large
    schemas, so call this off the event loop). A template that refuses or fails on the request is a 400."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] if req.tools_on else None
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    try:
        if fmt.hf is not None:
            prompt: ChatPrompt | list[int] = hf_chat_ids(fmt.hf, messages, tools=tools,
                                                         kwargs=req.chat_template_kwargs)
        else:
            assert fmt.template is not None
            prompt = fmt.template.prompt(messages, markers=fmt.markers, tools=tools, add_generation_prompt=True,
                                         kwargs=req.chat_template_kwargs)
    except ChatTemplateError as e:
        raise APIError(400, str(e), "invalid_request_error", param="messages") from None
    grammar = None
    if tools is not None and req.tool_choice not in (None, "auto"):
        forced = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else "required"
        grammar = _forcing_grammar(tools, forced, fmt.reasoning_parser is not None, req.parallel_tool_calls,
                                   max_grammar_bytes)
    return TemplateChat(prompt, tools is not None, fmt.reasoning_parser, req.parallel_tool_calls, grammar)


def _forcing_grammar(tools: list[dict[str, Any]], forced: str | dict[str, Any], reasoning: bool, parallel: bool,
                     max_grammar_bytes: int) -> str:
    for i, tool in enumerate(tools):
        field = f"tools[{i}].function.parameters"
        try:
            vet_json_schema(orjson.dumps(tool.get("function", {}).get("parameters", {})).decode())
        except InvalidRequest as e:
            raise APIError(400, e.message.replace("json_schema", field, 1), param=field) from None
    try:
        grammar = kimi_k2_forcing_grammar(tools, forced, reasoning, parallel)
    except (ValueError, RuntimeError) as e:  # xgrammar refusing a tool's parameter schema
        raise APIError(400, f"tools: {error_message(e)}", "invalid_request_error", param="tools") from None
    if (size := len(grammar.encode())) > max_grammar_bytes:
        raise APIError(400, f"tools: the grammar that forces the tool call is {size} bytes, over the limit of "
                       f"{max_grammar_bytes} bytes (--max-grammar-bytes)", param="tools")
    return grammar


def template_sampling(chat: TemplateChat, sampling: dict[str, Any]) -> dict[str, Any]:
    """A parsed reply keeps its special tokens in the text (the markup is made of them); a forced call brings its
    grammar."""
    out = dict(sampling, skip_special_tokens=False) if chat.parses else dict(sampling)
    if chat.grammar is not None:
        if any(k in out for k in _GRAMMAR_FIELDS):
            raise APIError(400, "a forced tool call (tool_choice 'required' or named) cannot be combined with"
                           " response_format, regex or ebnf", "invalid_request_error", param="tool_choice")
        out["ebnf"] = chat.grammar
    return out


class TemplateReply:
    """One choice: `push` each chunk of the engine's text (the stop token's own text is dropped at the end)."""

    def __init__(self, chat: TemplateChat, tokenizer: Tokenizer) -> None:
        self._reply = KimiK2Reply(tools=chat.tools, reasoning=chat.reasoning, parallel_calls=chat.parallel_calls)
        self._tok = tokenizer

    def push(self, text: str, finished: str | None, last_ids: list[int]) -> DeltaMessage:
        if finished is not None:
            text = without_stop_text(self._tok, text, last_ids)
        d = self._reply.push(text, final=finished is not None)
        calls = [DeltaToolCall(index=c.index, id=c.id, type="function",
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


def template_message(chat: TemplateChat, tokenizer: Tokenizer, text: str, finished: str | None, ids: list[int]
                     ) -> tuple[AssistantMessage, str | None]:
    reply = TemplateReply(chat, tokenizer)
    reply.push(text, finished or "length", ids)
    return reply.message(), reply.finish_reason(finished)
