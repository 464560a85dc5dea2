"""The OpenAI chat route's side for a checkpoint's own Jinja chat template (`runtime.tokenizer.chat_format`):
the request's messages, tools and `chat_template_kwargs` rendered by the template, and the reply read back by the
template family's parsers (`kimi_k2` tool calls, an optional `<think>` reasoning parser) into OpenAI's fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixk3.chat_prompt import ChatPrompt
from radixk3.chat_template import ChatTemplateError, hf_chat_ids
from radixk3.tokenizer import Tokenizer
from runtime.http.api_errors import APIError
from runtime.http.openai_protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)
from runtime.tokenizer.chat_format import ChatFormat
from runtime.tokenizer.k3_reply import without_stop_text
from runtime.tokenizer.kimi_k2_parser import KimiK2Reply


@dataclass(frozen=True)
class TemplateChat:
    prompt: ChatPrompt | list[int]  # rendered by radixk3, or ids from the transformers tokenizer's own template
    tools: bool  # the reply is parsed for tool calls
    reasoning: str | None  # the reasoning parser, if any
    parallel_calls: bool

    @property
    def parses(self) -> bool:
        return self.tools or self.reasoning is not None

    def ids(self, tokenizer: Tokenizer) -> list[int]:
        """The prompt's ids; no bos of radixk3's own: a template writes its bos if it wants one."""
        return list(self.prompt) if isinstance(self.prompt, list) else self.prompt.ids(tokenizer, add_bos=False)


def plan_template_chat(req: ChatCompletionRequest, fmt: ChatFormat) -> TemplateChat:
    """The rendered prompt; a template that refuses or fails on the request is a 400 naming the problem."""
    if req.tools_on and req.tool_choice not in (None, "auto"):
        raise APIError(400, "tool_choice 'required' or a named function is not supported with this model's chat "
                       "template (tool_choice 'auto' and 'none' are)", "invalid_request_error", param="tool_choice")
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
    return TemplateChat(prompt, tools is not None and fmt.tool_call_parser == "kimi_k2", fmt.reasoning_parser,
                        req.parallel_tool_calls)


def template_sampling(chat: TemplateChat, sampling: dict[str, Any]) -> dict[str, Any]:
    """A parsed reply keeps its special tokens in the text: the markup is made of them."""
    return dict(sampling, skip_special_tokens=False) if chat.parses else sampling


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
