"""Kimi K3's own chat encoding (the checkpoint's XTML, `encoding_k3`), as a `ChatPrompt`.

Every message is `<|open|>message role="R"[ name="N"]<|sep|>BODY<|close|>message<|sep|><|end_of_msg|>`:

- before the messages, with tools, a system message `type="tool-declare"` (a fixed preamble and the tools as
  compact JSON, keys sorted), then with thinking on a system message `type="thinking-effort"`;
- system and user bodies are their text; tool results are `role="tool" tool="NAME" index="I"`, each run of
  them put in the order of the calls it answers (matched by `tool_call_id`, or `NAME:POSITION`) and named after
  its call, I counting 1, 2, ... from the assistant message;
- assistant bodies: with thinking on `<|open|>think<|sep|>REASONING<|close|>think<|sep|>` (the markers even with
  no reasoning; off, no think block at all), `<|open|>response<|sep|>CONTENT<|close|>response<|sep|>`, and the
  calls in `<|open|>tools<|sep|>...<|close|>tools<|sep|>`: typed `argument` elements (strings raw, other values
  JSON), or one `json` element holding arguments that are not JSON;
- after the messages, `tool_choice` "required" / "none" and `response_format` json_object / json_schema each add
  a system message (`type="tool-choice"`, `type="response-format"`), then the generation prompt opens the
  assistant message and its think channel (thinking on) or its response channel.

Markers are special ids; everything else is text, and, as the checkpoint's tokenizer does, each piece of text
(a tag name, ` key`, `="`, an attribute value, `"`, a content) is encoded on its own (`ChatPrompt.piece`). No
BOS. Thinking is on by default with effort `max` (`K3ChatOptions`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from radixk3.chat_prompt import ChatPrompt
from radixk3.tokenizer import END_OF_MSG, XTML_CLOSE, XTML_OPEN, XTML_SEP, Encoder
from radixk3.vision.prompt import ImageSlot, expand_images, placeholder

Effort = Literal["low", "high", "max"]
EFFORTS: tuple[str, ...] = ("low", "high", "max")

_OPEN, _CLOSE, _SEP = ChatPrompt.marker(XTML_OPEN), ChatPrompt.marker(XTML_CLOSE), ChatPrompt.marker(XTML_SEP)
_END_OF_MSG = ChatPrompt.marker(END_OF_MSG)

_TOOL_DECLARE = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```"
_TOOL_DECLARE_DYNAMIC = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                         "You have access to all existing and extended tools.\n"
                         "Here are the specs for the extended tools.\n\n```json\n{}\n```")
_THINKING_EFFORT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the "
                    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                    "Now the system is invoked with `thinking_effort={}`.")
_TOOL_CHOICE = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_RAW_JSON = ("The system is invoked with `response_format={}`.\nYour response must be raw JSON data without "
             "markdown code blocks (```json) or any additional formatting.")
_SCHEMA = "\nThe JSON data must match the following schema:\n```json\n{}\n```"
# Content parts that carry an image: OpenAI chat's, the Responses API's, and SGLang's / Anthropic's plain one.
IMAGE_PART_TYPES = ("image_url", "input_image", "image")
_IMAGE_ROLES = ("user", "system", "assistant")  # tool results are reordered to the calls: no images there


class RenderError(ValueError):
    """A conversation the encoding cannot render (a client error: HTTP 400)."""


@dataclass(frozen=True)
class K3ChatOptions:
    thinking: bool = True
    effort: Effort = "max"
    tool_choice: str | None = None  # "required" and "none" add a system message; anything else none
    response_format: Mapping[str, Any] | None = None  # OpenAI's: {"type": ..., "json_schema": {...}}
    forced: bool = False  # a call is forced by a grammar (the reply parser allows its formatting whitespace)
    continue_final: bool = False  # the reply continues the final (assistant) message's response, left open


@dataclass(frozen=True)
class K3Prompt:
    prompt: ChatPrompt
    prefix: str  # the markup the prompt ends with, inside the reply: the parser starts from it
    thinking: bool
    forced: bool

    @property
    def text(self) -> str:
        return self.prompt.text

    def ids(self, encoder: Encoder) -> list[int]:
        return self.prompt.ids(encoder, add_bos=False)  # the checkpoint's encoding writes no BOS


def thinking_options(thinking: bool | None, effort: str | None, reasoning_effort: str | None) -> tuple[bool, Effort]:
    """Thinking and its effort as the checkpoint's template reads them: on with effort "max" unless told;
    `reasoning_effort` "none" turns thinking off (unless `thinking` says otherwise), another value is the effort
    (unless `effort` is given). RenderError for an effort K3 does not know."""
    if reasoning_effort == "none":
        thinking = False if thinking is None else thinking
    elif effort is None:
        effort = reasoning_effort
    effort = "max" if effort is None else effort
    if effort not in EFFORTS:
        raise RenderError(f"Kimi K3 supports the thinking efforts {', '.join(EFFORTS)}, not {effort!r}")
    return (True if thinking is None else thinking), effort  # type: ignore[return-value]


# --- markup ------------------------------------------------------------------------------------------------


def escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def open_tag(name: str, *attrs: tuple[str, object]) -> ChatPrompt:
    parts: list[ChatPrompt] = [_OPEN, ChatPrompt.piece(name)]
    for key, value in attrs:
        parts += [ChatPrompt.piece(f" {key}"), ChatPrompt.piece('="'), ChatPrompt.piece(escape_attr(str(value))),
                  ChatPrompt.piece('"')]
    return ChatPrompt.join([*parts, _SEP])


def close_tag(name: str) -> ChatPrompt:
    return _CLOSE + ChatPrompt.piece(name) + _SEP


def block(name: str, body: ChatPrompt, *attrs: tuple[str, object]) -> ChatPrompt:
    return open_tag(name, *attrs) + body + close_tag(name)


def _message(body: ChatPrompt, *attrs: tuple[str, object]) -> ChatPrompt:
    return block("message", body, *attrs) + _END_OF_MSG


def _system(kind: str, body: str) -> ChatPrompt:
    """A system message of the encoding's own (callers strip the bodies the checkpoint strips: all but the tool
    declaration's)."""
    return _message(ChatPrompt.piece(body), ("role", "system"), ("type", kind))


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def arg_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def arg_value(value: Any) -> str:
    """Strings raw, other values JSON (the checkpoint's `json.dumps`, default separators)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class Call:
    id: str | None
    name: str
    arguments: dict[str, Any]
    raw: str | None = None  # arguments that are not JSON, written in a `json` element


def call_markup(call: Call, index: int) -> ChatPrompt:
    """One call (`index` 1-based): its arguments typed, or its raw text in a `json` element."""
    if call.raw is not None:
        body = block("json", ChatPrompt.piece(call.raw), ("type", "object"))
    else:
        body = ChatPrompt.join(block("argument", ChatPrompt.piece(arg_value(v)), ("key", k), ("type", arg_type(v)))
                               for k, v in call.arguments.items())
    return block("call", body, ("tool", call.name), ("index", index))


def assistant_body(content: ChatPrompt, calls: Sequence[Call], reasoning: str | None, thinking: bool
                   ) -> ChatPrompt:
    """An assistant message's channels, as the model writes them (without the message's own markup)."""
    out = ChatPrompt()
    if thinking:
        out = block("think", ChatPrompt.piece(reasoning) if reasoning and reasoning.strip() else ChatPrompt())
    out += block("response", content)
    if calls:
        out += block("tools", ChatPrompt.join(call_markup(c, i) for i, c in enumerate(calls, start=1)))
    return out


# --- messages ----------------------------------------------------------------------------------------------


def is_image_part(part: Mapping[str, Any]) -> bool:
    return part.get("type") in IMAGE_PART_TYPES


def image_parts(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The messages' image parts in the order the prompt places them (the order `images` must follow): messages
    render in order, tool results (which may not carry images) aside."""
    return [p for m in messages if m.get("role") in _IMAGE_ROLES and isinstance(m.get("content"), list)
            for p in m["content"] if is_image_part(p)]


def _content(m: Mapping[str, Any]) -> ChatPrompt:
    """Each text (the string, or each text part) is a piece; each image part the image placeholder."""
    c = m.get("content")
    if c is None:
        return ChatPrompt()
    if isinstance(c, str):
        return ChatPrompt.piece(c)
    return ChatPrompt.join(placeholder() if is_image_part(p) else ChatPrompt.piece(str(p["text"])) for p in c)


def _call(raw: Mapping[str, Any]) -> Call:
    fn = raw.get("function", raw)
    args: Any = fn.get("arguments")
    text = None
    if isinstance(args, str):
        if not args.strip():
            args = {}
        else:
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args, text = {}, fn.get("arguments")
    elif args is None:
        args = {}
    if not isinstance(args, dict):
        raise RenderError(f"tool call {raw.get('id')!r}: arguments must be a JSON object")
    cid = raw.get("id")
    return Call(None if cid is None else str(cid), str(fn.get("name", "")), args, text)


def _results_in_call_order(results: list[Mapping[str, Any]], calls: list[Call], aliases: bool
                           ) -> list[Mapping[str, Any]]:
    """A run of tool results in the order of the calls they answer (ties in their own order), each named
    after its call; left as it is when one of them answers no call. Matched by `tool_call_id`, and right after
    the assistant message also by `NAME:POSITION` (0-based), as the checkpoint's renderer does."""
    targets: dict[str, tuple[int, str]] = {}
    for k, c in enumerate(calls):
        if c.id is not None:
            targets.setdefault(c.id, (k, c.name))
    if aliases:
        for k, c in enumerate(calls):
            if c.name:
                targets.setdefault(f"{c.name}:{k}", (k, c.name))
    found = [targets.get(str(r.get("tool_call_id"))) if r.get("tool_call_id") is not None else None
             for r in results]
    if any(t is None for t in found):
        return results
    order = sorted(range(len(results)), key=lambda i: (found[i][0], i))  # type: ignore[index]
    return [{**results[i], "tool": found[i][1]} for i in order]  # type: ignore[index]


def _messages(messages: Sequence[Mapping[str, Any]], thinking: bool) -> ChatPrompt:
    out: list[ChatPrompt] = []
    calls: list[Call] = []
    index = 0
    i = 0
    while i < len(messages):
        m = messages[i]
        role = m.get("role")
        if role == "tool":
            j = i
            while j < len(messages) and messages[j].get("role") == "tool":
                j += 1
            after_assistant = i > 0 and messages[i - 1].get("role") == "assistant"
            if image_parts([{**r, "role": "user"} for r in messages[i:j]]):
                raise RenderError("a tool message cannot carry an image part")
            for r in _results_in_call_order(list(messages[i:j]), calls, aliases=after_assistant):
                index += 1
                name = r.get("tool", r.get("name"))
                if name is None and index <= len(calls):
                    name = calls[index - 1].name
                if name is None:
                    raise RenderError(f"tool message for {r.get('tool_call_id')!r}: no tool name (it answers no "
                                      "call of the assistant message before it)")
                out.append(_message(_content(r), ("role", "tool"), ("tool", name), ("index", index)))
            i = j
            continue
        named = (("name", m["name"]),) if m.get("name") else ()
        if role == "user" or (role == "system" and not m.get("tools")):
            out.append(_message(_content(m), ("role", role), *named))
        elif role == "system":
            out.append(_system("tool-declare", _TOOL_DECLARE_DYNAMIC.format(compact_json(m["tools"]))))
        elif role == "assistant":
            calls, index = [_call(c) for c in m.get("tool_calls") or []], 0
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            body = assistant_body(_content(m), calls, None if reasoning is None else str(reasoning), thinking)
            out.append(_message(body, ("role", "assistant"), *named))
        i += 1  # another role renders nothing, as in the checkpoint's encoding
    return ChatPrompt.join(out)


def _response_schema(response_format: Mapping[str, Any]) -> Any:
    spec = response_format.get("json_schema")
    if isinstance(spec, dict):
        return spec.get("schema", spec.get("json_schema", spec))
    return spec


def _response_format(response_format: Mapping[str, Any] | str | None) -> ChatPrompt:
    kind = response_format.get("type", response_format) if isinstance(response_format, Mapping) else response_format
    if kind == "json_object":
        return _system("response-format", _RAW_JSON.format("json_object").strip())
    if kind == "json_schema":
        schema = _response_schema(response_format) if isinstance(response_format, Mapping) else None
        body = _RAW_JSON.format("json_schema") + _SCHEMA.format(compact_json(schema))
        return _system("response-format", body.strip())
    return ChatPrompt()


def render_k3_chat(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                   options: K3ChatOptions = K3ChatOptions(), add_generation_prompt: bool = True,
                   images: Sequence[ImageSlot] = ()) -> K3Prompt:
    """The conversation in K3's encoding (`K3Prompt.ids` gives its markers, and only them, special ids) and the
    prefix the reply continues. `tools` are OpenAI function tools. `images` are the image parts' sizes and token
    counts, in `image_parts` order: each part's placeholder expands to the media markers and its pad ids."""
    prompt = _render(messages, tools, options, add_generation_prompt)
    try:
        return dataclasses.replace(prompt, prompt=expand_images(prompt.prompt, images))
    except ValueError as e:
        raise RenderError(f"messages: {e}") from None


def _render(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
            options: K3ChatOptions, add_generation_prompt: bool) -> K3Prompt:
    out: list[ChatPrompt] = []
    if tools:
        out.append(_system("tool-declare", _TOOL_DECLARE.format(compact_json(list(tools)))))
    if options.thinking:
        out.append(_system("thinking-effort", _THINKING_EFFORT.format(options.effort).strip()))
    final = messages[-1] if options.continue_final and messages else None
    out.append(_messages(messages if final is None else messages[:-1], options.thinking))
    if options.tool_choice in _TOOL_CHOICE:
        out.append(_system("tool-choice", _TOOL_CHOICE[options.tool_choice].strip()))
    out.append(_response_format(options.response_format))
    if final is not None:
        return _continued(final, options, ChatPrompt.join(out))
    start = open_tag("think" if options.thinking else "response")
    if add_generation_prompt:
        out += [open_tag("message", ("role", "assistant")), start]
    return K3Prompt(ChatPrompt.join(out), start.text, options.thinking, options.forced)


def _continued(final: Mapping[str, Any], options: K3ChatOptions, before: ChatPrompt) -> K3Prompt:
    """The prompt ending inside the final assistant message's response channel, after its content: the reply
    continues that text (its reasoning, if any, is closed before)."""
    if final.get("role") != "assistant" or final.get("tool_calls"):
        raise RenderError("continue_final_message: the final message must be an assistant message without "
                          "tool_calls")
    named = (("name", final["name"]),) if final.get("name") else ()
    body = ChatPrompt()
    if options.thinking:
        reasoning = str(final.get("reasoning_content") or final.get("reasoning") or "")
        body = block("think", ChatPrompt.piece(reasoning) if reasoning.strip() else ChatPrompt())
    start = open_tag("response")
    prompt = ChatPrompt.join([before, open_tag("message", ("role", "assistant"), *named), body, start, _content(final)])
    return K3Prompt(prompt, start.text, False, options.forced)
