"""The OpenAI chat route's side for a checkpoint's own Jinja chat template (`runtime.tokenizer.chat_format`):
the request's messages, tools and `chat_template_kwargs` rendered by the template, a forced call's grammar
(`runtime.tokenizer.kimi_k2_grammar`), and the reply read back by the template family's parsers (`kimi_k2` tool
calls, an optional `<think>` reasoning parser) into OpenAI's fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixk3.chat_prompt import ChatPrompt
from radixk3.chat_template import ChatTemplateError, hf_chat_ids
from radixk3.tokenizer import Tokenizer
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
from runtime.tokenizer.chat_format import ChatFormat
from runtime.tokenizer.kimi_k2_grammar import kimi_k2_forcing_grammar
from runtime.tokenizer.kimi_k2_parser import KimiK2Reply


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

    def parser(self) -> KimiK2Reply:
        return KimiK2Reply(tools=self.tools, reasoning=self.reasoning, parallel_calls=self.parallel_calls)

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
                                                         kwargs=req.chat_template_kwargs,
                                                         continue_final_message=req.continue_final_message)
        else:
            assert fmt.template is not None
            prompt = fmt.template.prompt(messages, markers=fmt.markers, tools=tools, add_generation_prompt=True,
                                         kwargs=req.chat_template_kwargs,
                                         continue_final_message=req.continue_final_message)
    except ChatTemplateError as e:
        raise APIError(400, str(e), "invalid_request_error", param="messages") from None
    grammar = None
    if tools is not None and req.tool_choice not in (None, "auto"):
        if req.continue_final_message:
            raise refuse_continued_forced_call()
        forced = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else "required"
        reasoning, parallel = fmt.reasoning_parser is not None, req.parallel_tool_calls
        grammar = forcing_grammar_checked(
            tools, lambda: kimi_k2_forcing_grammar(tools, forced, reasoning, parallel), max_grammar_bytes)
    return TemplateChat(prompt, tools is not None, fmt.reasoning_parser, req.parallel_tool_calls, grammar)


def template_sampling(chat: TemplateChat, sampling: dict[str, Any]) -> dict[str, Any]:
    """A parsed reply keeps its special tokens in the text (the markup is made of them); a forced call brings its
    grammar."""
    out = dict(sampling, skip_special_tokens=False) if chat.parses else dict(sampling)
    if chat.grammar is not None:
        if any(k in out for k in GRAMMAR_FIELDS):
            raise refuse_own_grammar()
        out["ebnf"] = chat.grammar
    return out
