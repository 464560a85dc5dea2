"""The OpenAI chat route's K3 side: a chat becomes a prompt in K3's own encoding (`runtime.tokenizer.k3_encoding`;
and, when a call is forced, a grammar); the engine's text (special tokens kept) goes through the reply assembler
(`runtime.tokenizer.k3_reply`), whose replies and deltas this maps to OpenAI's message fields.

With thinking on, a request's own grammar (response_format, regex, ebnf) holds from the response channel on:
the reasoning before it runs free, as a reasoning parser lets it in SGLang and vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from radixk3.vision.prompt import ImageSlot
from runtime.errors import InvalidRequest
from runtime.grammar_compile import ANY_JSON, error_message, xgrammar_module
from runtime.grammar_schema import vet_json_schema
from runtime.http.api_errors import APIError
from runtime.http.chat_reply import (
    GRAMMAR_FIELDS,
    forcing_grammar_checked,
    refuse_continued_forced_call,
    refuse_own_grammar,
)
from runtime.http.openai_protocol import (
    ChatCompletionRequest,
    NamedToolChoice,
)
from runtime.tokenizer.k3_encoding import K3ChatOptions, K3Prompt, RenderError, render_k3_chat, thinking_options
from runtime.tokenizer.k3_reply import ReplyAssembler
from runtime.tokenizer.k3_tools import forcing_grammar, request_grammar_after_thinking


@dataclass(frozen=True)
class K3Chat:
    prompt: K3Prompt
    parse_tools: bool
    grammar: str | None  # EBNF in place of the request's own grammar: a forced call, or its own after thinking
    forced: bool  # a tool call is forced (tool_choice "required" or named)
    parallel_calls: bool  # OpenAI's parallel_tool_calls: off, a reply keeps its first call only

    def parser(self) -> ReplyAssembler:
        return ReplyAssembler(self.prompt.prefix, tools=self.parse_tools, forced=self.forced,
                              parallel=self.parallel_calls)


def plan_k3_chat(req: ChatCompletionRequest, max_grammar_bytes: int, images: Sequence[ImageSlot] = ()) -> K3Chat:
    """The K3 prompt (its image parts expanded for `images`, in `image_parts` order), and the grammar when a call
    is forced (or when the request's own grammar follows the reasoning). A forcing grammar is built from the
    tools' parameter schemas, which are held to what a request's own json_schema is held to (depth, supported
    features, and the grammar's size, `--max-grammar-bytes`). It may take a while for large schemas: call it off
    the event loop."""
    if (problem := req.k3_template_kwargs_problem()) is not None:
        raise APIError(400, problem, "invalid_request_error", param="chat_template_kwargs")
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice
    forced: str | dict[str, Any] | None = None  # as xgrammar takes tool_choice
    if tools and isinstance(choice, NamedToolChoice):
        forced = choice.model_dump()
    elif tools and choice == "required":
        forced = "required"
    own = {k: v for k, v in req.sampling(req.max_new_tokens).items() if k in GRAMMAR_FIELDS}
    if forced is not None and own:
        raise refuse_own_grammar()
    if forced is not None and req.continue_final_message:
        raise refuse_continued_forced_call()
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    kw = req.chat_template_kwargs or {}
    try:
        thinking, effort = thinking_options(kw.get("thinking", kw.get("enable_thinking")), kw.get("thinking_effort"),
                                            req.reasoning_effort)
    except RenderError as e:  # an effort K3 does not know: the field that gave it
        field = "chat_template_kwargs" if "thinking_effort" in kw else "reasoning_effort"
        raise APIError(400, f"{field}: {e}", "invalid_request_error", param=field) from None
    try:
        fmt = req.response_format.model_dump(by_alias=True, exclude_none=True) if req.response_format else None
        options = K3ChatOptions(thinking, effort, choice if isinstance(choice, str) else None, fmt, forced is not None,
                                req.continue_final_message)
        prompt = render_k3_chat(messages, tools, options, images=images)
    except RenderError as e:
        raise APIError(400, str(e), "invalid_request_error", param="messages") from None
    except (ValueError, RuntimeError) as e:  # a tool's schema the declaration cannot write
        raise APIError(400, f"tools: {error_message(e)}", "invalid_request_error", param="tools") from None
    grammar = None
    if forced is not None:
        grammar = forcing_grammar_checked(
            tools, lambda: forcing_grammar(tools, forced, thinking, req.parallel_tool_calls), max_grammar_bytes)
    # A continued message is past its reasoning already: its own grammar holds from the start, as without thinking.
    if thinking and len(own) == 1 and not req.continue_final_message:  # more than one: the sampling parameters refuse
        grammar = _own_grammar_after_thinking(*next(iter(own.items())))
    return K3Chat(prompt, bool(tools) and choice != "none", grammar, forced is not None, req.parallel_tool_calls)


def _own_grammar_after_thinking(field: str, source: Any) -> str:
    """The request's own grammar from the response channel on, held to the limits its own field is held to (the
    sampling parameters hold the EBNF's size to `--max-grammar-bytes`). Any JSON (json_object) is xgrammar's
    built-in JSON grammar, as without thinking."""
    if field == "json_schema" and source == ANY_JSON:
        field, source = "ebnf", str(xgrammar_module().Grammar.builtin_json_grammar())
    if field == "json_schema":
        try:
            vet_json_schema(source if isinstance(source, str) else orjson.dumps(source).decode())
        except InvalidRequest as e:
            raise APIError(400, e.message, param=field) from None
    try:
        return request_grammar_after_thinking(field, source)
    except (ValueError, RuntimeError) as e:
        raise APIError(400, f"invalid {field}: {error_message(e)}", "invalid_request_error", param=field) from None


def k3_sampling(chat: K3Chat, sampling: dict[str, Any]) -> dict[str, Any]:
    """The parser reads the markup, so special tokens stay in the text; the chat's grammar (a forced call, or
    the request's own after thinking) takes the place of the request's."""
    out = dict(sampling, skip_special_tokens=False)
    if chat.grammar is not None:
        out = {k: v for k, v in out.items() if k not in GRAMMAR_FIELDS} | {"ebnf": chat.grammar}
    return out
