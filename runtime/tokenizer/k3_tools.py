"""K3 chat rendering with tools and thinking (`runtime.tokenizer.k3_reply` assembles the replies).

Messages keep Kimi's role framing (`radixk3.tokenizer.chat_turn`); what K3 adds is XTML inside:

- the tool declaration: a `tool_declare` system message holding the OpenAI function tools as JSON (Kimi's);
- assistant turns: `[<|open|>think<|sep|>R<|close|>think<|sep|>]<|open|>response<|sep|>C<|close|>response<|sep|>`
  then the calls (`runtime.tokenizer.k3_stream_parser` has the grammar) and `<|close|>message<|sep|><|end_of_msg|>`;
  argument values are raw strings or JSON, attributes escape `&` and `"`, indices are 1-based;
- tool results: one `tool` message per result, a system turn named `tool` holding
  `<|open|>result tool="NAME" index="I"<|sep|>...<|close|>result<|sep|>`, reordered to the order of the
  assistant's calls and annotated with the call's name and 1-based index;
- the generation prefix ends at `<|open|>think<|sep|>` when thinking, else `<|open|>response<|sep|>`.

The prompt is a `ChatPrompt`: the markers are the renderer's, everything it was given (contents, names, tool
definitions, call names, argument keys and values, results, reasoning) is text, so a marker typed there never
becomes a special id.

Forced tool calls (`tool_choice` "required" or named) are constrained by xgrammar's `kimi_k3` structural tag
(the grammar of the whole rest of the reply), handed to the grammar backend as EBNF.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from radixk3.chat_prompt import ChatPrompt
from radixk3.tokenizer import END_OF_MSG, XTML_CLOSE, XTML_OPEN, XTML_SEP, chat_turn, turn_start

_OPEN, _CLOSE, _SEP = ChatPrompt.marker(XTML_OPEN), ChatPrompt.marker(XTML_CLOSE), ChatPrompt.marker(XTML_SEP)
_THINK_START = _OPEN + "think" + _SEP
_RESPONSE_START = _OPEN + "response" + _SEP
# A forced reply without thinking is its calls: the prompt closes the (empty) response itself.
_FORCED_START = _RESPONSE_START + _CLOSE + "response" + _SEP
_MESSAGE_END = _CLOSE + "message" + _SEP + ChatPrompt.marker(END_OF_MSG)
# The generation prefixes as the reply parser reads them (the reply's text, markers written out).
THINK_PREFIX, RESPONSE_PREFIX, FORCED_PREFIX = _THINK_START.text, _RESPONSE_START.text, _FORCED_START.text


class RenderError(ValueError):
    """A conversation the template cannot render (a client error: HTTP 400)."""


@dataclass(frozen=True)
class K3Prompt:
    prompt: ChatPrompt
    prefix: str  # the markup the prompt ends with, inside the reply: the parser starts from it
    thinking: bool
    forced: str | None  # "required" or the forced tool's name

    @property
    def text(self) -> str:
        return self.prompt.text


def escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _open(name: str, **attrs: str) -> ChatPrompt:
    return _OPEN + name + "".join(f' {k}="{escape_attr(v)}"' for k, v in attrs.items()) + _SEP


def _close(name: str) -> ChatPrompt:
    return _CLOSE + name + _SEP


def _block(name: str, body: ChatPrompt | str, **attrs: str) -> ChatPrompt:
    return _open(name, **attrs) + body + _close(name)


def _arg_type(v: Any) -> str:
    if isinstance(v, str):
        return "string"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float):
        return "number"
    if v is None:
        return "null"
    if isinstance(v, dict):
        return "object"
    if isinstance(v, list):
        return "array"
    raise RenderError(f"tool call argument of type {type(v).__name__} is not JSON")


def _call(name: str, arguments: Mapping[str, Any], index: int) -> ChatPrompt:
    """One call: typed `argument` elements, strings raw, other values JSON; `index` is 1-based."""
    args = ChatPrompt.join(_block("argument", v if isinstance(v, str) else orjson.dumps(v).decode(), key=k,
                                  type=_arg_type(v)) for k, v in arguments.items())
    return _block("call", args, tool=name, index=str(index))


def _reply(content: str | None, calls: Sequence[tuple[str, Mapping[str, Any]]], reasoning: str | None
           ) -> ChatPrompt:
    out = _block("think", reasoning) if reasoning is not None else ChatPrompt()
    out += _block("response", content or "")
    if calls:
        out += _block("tools", ChatPrompt.join(_call(n, a, i + 1) for i, (n, a) in enumerate(calls)))
    return out + _MESSAGE_END


def render_reply(content: str | None, calls: Sequence[tuple[str, Mapping[str, Any]]] = (),
                 reasoning: str | None = None) -> str:
    """An assistant reply as the model writes it, from the first channel to the end of the message."""
    return _reply(content, calls, reasoning).text


def _arguments(call: Mapping[str, Any]) -> tuple[str, str, dict[str, Any]]:
    fn = call.get("function") or {}
    raw = fn.get("arguments", "{}")
    try:
        args = orjson.loads(raw) if isinstance(raw, str) else raw
    except orjson.JSONDecodeError as e:
        raise RenderError(f"tool call {call.get('id')!r}: arguments are not JSON ({e})") from None
    if not isinstance(args, dict):
        raise RenderError(f"tool call {call.get('id')!r}: arguments must be a JSON object")
    return str(call.get("id", "")), str(fn.get("name", "")), args


def _tool_results(calls: list[tuple[str, str, dict[str, Any]]], results: list[Mapping[str, Any]]) -> ChatPrompt:
    """Tool messages in the order of the calls they answer, each annotated with its call's name and index."""
    order = {cid: k for k, (cid, _, _) in enumerate(calls)}
    placed: dict[int, Mapping[str, Any]] = {}
    for r in results:
        k = order.get(r.get("tool_call_id"))  # type: ignore[arg-type]
        if k is None:
            raise RenderError(f"tool message for {r.get('tool_call_id')!r} answers no call of the assistant before it")
        if k in placed:
            raise RenderError(f"two tool messages answer the call {r.get('tool_call_id')!r}")
        placed[k] = r
    return ChatPrompt.join(chat_turn("system", _block("result", _text(placed[k]), tool=calls[k][1],
                                                      index=str(k + 1)), name="tool") for k in sorted(placed))


def _text(m: Mapping[str, Any]) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    return "".join(p["text"] for p in c)


def render_k3_chat(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                   thinking: bool = False, forced: str | None = None) -> K3Prompt:
    """The prompt (`K3Prompt.prompt.ids` gives its markers, and only them, their special ids) and the prefix the
    reply continues. `tools` are OpenAI function tools, already filtered by `tool_choice` ("none": no tools)."""
    out: list[ChatPrompt] = []
    if tools:
        out.append(chat_turn("system", orjson.dumps(list(tools)).decode(), name="tool_declare"))
    calls: list[tuple[str, str, dict[str, Any]]] = []
    results: list[Mapping[str, Any]] = []
    for m in [*messages, None]:
        if results and (m is None or m.get("role") != "tool"):
            out.append(_tool_results(calls, results))
            results = []
        if m is None:
            break
        role = m.get("role")
        if role == "tool":
            if not calls:
                raise RenderError("a tool message must follow an assistant message with tool_calls")
            results.append(m)
        elif role == "assistant":
            calls = [_arguments(c) for c in m.get("tool_calls") or []]
            body = _reply(_text(m), [(n, a) for _, n, a in calls], m.get("reasoning_content"))
            out.append(turn_start("assistant", m.get("name")) + body)  # the reply's markup ends it
        elif role in ("system", "user"):
            out.append(chat_turn(role, _text(m), m.get("name")))
        else:
            raise RenderError(f"unsupported chat role {role!r}")
    start = _THINK_START if thinking else _FORCED_START if forced else _RESPONSE_START
    out.append(turn_start("assistant") + start)
    return K3Prompt(ChatPrompt.join(out), start.text, thinking, forced)


def forcing_grammar(tools: Sequence[Mapping[str, Any]], tool_choice: str | Mapping[str, Any],
                    thinking: bool, parallel: bool = True) -> str:
    """EBNF of the rest of a reply that must call a tool (any for "required", else the named one), from
    xgrammar's `kimi_k3` structural tag. Without thinking the prompt ends at `FORCED_PREFIX` (an empty
    response: a forced reply is its calls), so the grammar starts at the tools section."""
    import xgrammar as xgr
    from xgrammar import structural_tag as st

    # One whitespace at most where the grammar allows it, and call indices of at most three digits:
    # unbounded repeats would let a weak model loop inside the markup until max_tokens.
    tag = xgr.get_model_structural_tag("kimi_k3", tools=list(tools), tool_choice=tool_choice,  # type: ignore[arg-type]
                                       reasoning="enabled" if thinking else "disabled", max_whitespace_cnt=1,
                                       parallel_tool_calls=parallel)
    elements = list(tag.format.elements)  # type: ignore[union-attr]
    if not thinking:
        elements = elements[-2:]  # the tools section and the message end
    tag = xgr.StructuralTag(format=st.SequenceFormat(elements=[_bounded_index(e) for e in elements]))
    return str(xgr.Grammar.from_structural_tag(tag))


def _bounded_index(fmt: Any) -> Any:
    from pydantic import BaseModel
    from xgrammar import structural_tag as st

    if isinstance(fmt, st.RegexFormat) and fmt.pattern == r"\d+":
        return st.RegexFormat(pattern="[1-9][0-9]{0,2}")
    if isinstance(fmt, list):
        return [_bounded_index(f) for f in fmt]
    if isinstance(fmt, BaseModel):
        return fmt.model_copy(update={k: _bounded_index(getattr(fmt, k)) for k in type(fmt).model_fields})
    return fmt
