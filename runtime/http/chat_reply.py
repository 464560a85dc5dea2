"""What the chat route shares across the chat formats whose replies it parses (K3's XTML after the K3 encoding,
K2's markup after a Jinja template): the checks of a forced call's tools and grammar, and one choice's reply
read by the format's parser and mapped to OpenAI's message fields."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import orjson

from radixk3.tokenizer import Tokenizer
from runtime.errors import InvalidRequest
from runtime.grammar_compile import error_message
from runtime.grammar_schema import vet_json_schema
from runtime.http.api_errors import APIError
from runtime.http.openai_protocol import AssistantMessage, DeltaMessage, DeltaToolCall, FunctionCallOut, ToolCallOut
from runtime.tokenizer.k3_reply import ParsedReply, ReplyDelta, without_stop_text


def vet_tool_parameters(tools: Sequence[dict[str, Any]]) -> None:
    """A forced call's tools: each parameter schema is held to what a request's own json_schema is held to (depth,
    supported features); 400 naming the tool's field."""
    for i, tool in enumerate(tools):
        field = f"tools[{i}].function.parameters"
        try:
            vet_json_schema(orjson.dumps(tool.get("function", {}).get("parameters", {})).decode())
        except InvalidRequest as e:
            raise APIError(400, e.message.replace("json_schema", field, 1), param=field) from None


GRAMMAR_FIELDS = ("regex", "ebnf", "json_schema")  # a request's own grammar, which a forced call cannot join


def refuse_own_grammar() -> APIError:
    return APIError(400, "a forced tool call (tool_choice 'required' or named) cannot be combined with"
                    " response_format, regex or ebnf", "invalid_request_error", param="tool_choice")


def refuse_continued_forced_call() -> APIError:
    return APIError(400, "continue_final_message cannot be combined with a forced tool call (tool_choice "
                    "'required' or named)", "invalid_request_error", param="continue_final_message")


def forcing_grammar_checked(tools: Sequence[dict[str, Any]], build: Callable[[], str], max_grammar_bytes: int) -> str:
    """The grammar forcing a tool call, `build()` (the chat format's), after its tools' checks: 400 naming the
    tools when xgrammar refuses a parameter schema or the grammar is over `--max-grammar-bytes`."""
    vet_tool_parameters(tools)
    try:
        grammar = build()
    except (ValueError, RuntimeError) as e:  # xgrammar refusing a tool's parameter schema
        raise APIError(400, f"tools: {error_message(e)}", "invalid_request_error", param="tools") from None
    if (size := len(grammar.encode())) > max_grammar_bytes:
        raise APIError(400, f"tools: the grammar that forces the tool call is {size} bytes, over the limit of "
                       f"{max_grammar_bytes} bytes (--max-grammar-bytes)", param="tools")
    return grammar


class ReplyParser(Protocol):
    """A chat format's reader of one reply (`k3_reply.ReplyAssembler`, `kimi_k2_parser.KimiK2Reply`)."""

    def push(self, text: str, final: bool = False) -> ReplyDelta: ...

    def reply(self) -> ParsedReply: ...

    def finish_reason(self, finished: str | None) -> str | None: ...


class ChatReply:
    """One choice: `push` each chunk of the engine's text (the stop token's own text is dropped at the end).

    SGLang's reasoning options: `separate_reasoning=False` puts the reasoning back into the content, before the
    reply's text; `stream_reasoning=False` holds the reasoning back until the last chunk, which carries all of it."""

    def __init__(self, parser: ReplyParser, tokenizer: Tokenizer, *, separate_reasoning: bool = True,
                 stream_reasoning: bool = True) -> None:
        self._reply = parser
        self._tok = tokenizer
        self._separate = separate_reasoning
        self._stream_reasoning = stream_reasoning
        self._held: list[str] = []  # reasoning not streamed yet

    def push(self, text: str, finished: str | None, last_ids: list[int]) -> DeltaMessage:
        if finished is not None:
            text = without_stop_text(self._tok, text, last_ids)
        d = self._reply.push(text, final=finished is not None)
        content, reasoning = d.content, d.reasoning
        if not self._separate:
            content, reasoning = reasoning + content, ""
        elif not self._stream_reasoning:
            self._held.append(reasoning)
            reasoning = "".join(self._held) if finished is not None else ""
        calls = [DeltaToolCall(index=c.index, id=c.id, type="function" if c.name is not None else None,
                               function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in d.tool_calls]
        return DeltaMessage(content=content or None, reasoning_content=reasoning or None, tool_calls=calls or None)

    def message(self) -> AssistantMessage:
        r = self._reply.reply()
        calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                 for c in r.tool_calls]
        content, reasoning = r.content, r.reasoning_content
        if not self._separate:
            content, reasoning = ((reasoning or "") + (content or "")) or None, None
        return AssistantMessage(content=content, reasoning_content=reasoning, tool_calls=calls or None)

    def finish_reason(self, finished: str | None) -> str | None:
        return self._reply.finish_reason(finished)


def whole_reply(parser: ReplyParser, tokenizer: Tokenizer, text: str, finished: str | None, ids: list[int], *,
                separate_reasoning: bool = True) -> tuple[AssistantMessage, str | None]:
    """A whole (non-streamed) choice's message and finish reason."""
    reply = ChatReply(parser, tokenizer, separate_reasoning=separate_reasoning)
    reply.push(text, finished or "length", ids)
    return reply.message(), reply.finish_reason(finished)
