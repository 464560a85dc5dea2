"""Incremental parser of K3's assistant output markup (XTML) into reasoning, content and tool calls.

The output continues the generation prefix (`<|open|>think<|sep|>` or `<|open|>response<|sep|>`, or a forced
prefix up to the tools or the call opening): feed that prefix first, then the model's text in pieces of any size;
each `feed` returns what became certain. The grammar of a message:

    [<|open|>think<|sep|> REASONING <|close|>think<|sep|>]
    [<|open|>response<|sep|> CONTENT <|close|>response<|sep|>]
    [<|open|>tools<|sep|> (<|open|>call tool="NAME" index="I"<|sep|>
        ((<|open|>argument key="K" type="T"<|sep|> VALUE <|close|>argument<|sep|>)*
         | <|open|>json type="object"<|sep|> RAW <|close|>json<|sep|>) <|close|>call<|sep|>)*
     <|close|>tools<|sep|>]
    <|close|>message<|sep|>

(the `json` element holds arguments that are not JSON, as K3's encoding writes them: they are the call's
arguments as they stand).

Reasoning and content stream as they come; a tool call is released whole when its close marker arrives
(its name first, then the arguments in fragments), so a call that turns out malformed was never half sent.
Malformed markup does not fail: from the first point where the text leaves the grammar, the raw text (with any
unfinished call it interrupted) becomes plain content. With parallel calls off (OpenAI's `parallel_tool_calls:
false`) the message ends at its first call: once that call is released the rest of the text (further calls,
well-formed or not, and the closing markup) is dropped, neither calls nor content. Because one machine serves
the streamed and the one-shot parse, the deltas of any split of a text add up to the parse of the whole text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum, auto

import orjson

from radixk3.tokenizer import END_OF_MSG, XTML_CLOSE, XTML_OPEN, XTML_SEP

# "integer" is not K3's own (it writes integers as "number") but xgrammar's kimi_k3 grammar allows it.
ARG_TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
_HEADS = (XTML_OPEN, XTML_CLOSE)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ATTR = re.compile(r' ([A-Za-z_][A-Za-z0-9_]*)="([^"]*)"')


def unescape_attr(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


class Phase(Enum):
    START = auto()
    THINK = auto()
    AFTER_THINK = auto()
    RESPONSE = auto()
    AFTER_RESPONSE = auto()
    TOOLS = auto()
    CALL = auto()
    ARGUMENT = auto()
    JSON = auto()  # a call's arguments that are not JSON
    AFTER_JSON = auto()
    AFTER_TOOLS = auto()
    DONE = auto()
    PLAIN = auto()  # left the grammar: everything from here is content
    CUT = auto()  # past the one call allowed (parallel calls off): everything from here is dropped


# (phase, "open"|"close", channel) -> next phase
_MOVES: dict[tuple[Phase, str, str], Phase] = {
    (Phase.START, "open", "think"): Phase.THINK,
    (Phase.START, "open", "response"): Phase.RESPONSE,
    (Phase.START, "open", "tools"): Phase.TOOLS,
    (Phase.START, "close", "message"): Phase.DONE,
    (Phase.THINK, "close", "think"): Phase.AFTER_THINK,
    (Phase.AFTER_THINK, "open", "response"): Phase.RESPONSE,
    (Phase.AFTER_THINK, "open", "tools"): Phase.TOOLS,
    (Phase.AFTER_THINK, "close", "message"): Phase.DONE,
    (Phase.RESPONSE, "close", "response"): Phase.AFTER_RESPONSE,
    (Phase.AFTER_RESPONSE, "open", "tools"): Phase.TOOLS,
    (Phase.AFTER_RESPONSE, "close", "message"): Phase.DONE,
    (Phase.TOOLS, "open", "call"): Phase.CALL,
    (Phase.TOOLS, "close", "tools"): Phase.AFTER_TOOLS,
    (Phase.CALL, "open", "argument"): Phase.ARGUMENT,
    (Phase.CALL, "close", "call"): Phase.TOOLS,
    (Phase.ARGUMENT, "close", "argument"): Phase.CALL,
    (Phase.CALL, "open", "json"): Phase.JSON,
    (Phase.JSON, "close", "json"): Phase.AFTER_JSON,
    (Phase.AFTER_JSON, "close", "call"): Phase.TOOLS,
    (Phase.AFTER_TOOLS, "close", "message"): Phase.DONE,
}
_REQUIRED_ATTRS = {"call": ("tool",), "argument": ("key", "type")}
_OPTIONAL_ATTRS = {"call": ("index",), "json": ("type",)}


@dataclass
class ToolCallDelta:
    """One streamed piece of a tool call: the first carries id and name, the rest argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class _Call:
    name: str
    args: list[tuple[str, str]] = field(default_factory=list)  # (key, value as JSON text)
    key: str = ""
    type: str = ""
    value: str = ""
    raw: str | None = None  # arguments that are not JSON (a `json` element)


class _Malformed(Exception):
    pass


def call_id(name: str, position: int) -> str:
    """Kimi's tool call id: the function's name and the call's 0-based position in the message."""
    return f"functions.{name}:{position}"


class K3StreamParser:
    """Feed text (markers kept, `skip_special_tokens=False`), get `Delta`s; `finish` at the end of output."""

    def __init__(self, prefix: str = "", *, tools: bool = True, strip_strings: bool = False,
                 parallel_calls: bool = True) -> None:
        """`strip_strings`: string values lose surrounding whitespace, which the forcing grammar (xgrammar's
        kimi_k3) allows around every value as formatting; K3's own markup writes strings raw. `parallel_calls`
        off: at most one call, the text after it dropped."""
        self._tools = tools
        self._parallel = parallel_calls
        self._strip = strip_strings
        self._phase = Phase.START
        self._buf = ""
        # Raw text since the last released text or call (markup, an unfinished call): content if the markup breaks.
        self._pending = ""
        self._call: _Call | None = None
        self._calls = 0
        self._out = Delta()
        self.reasoning_ended = False
        self.feed(prefix)  # the prompt's own markup: it moves the phase, its output is not the model's
        self._out, self._pending = Delta(), ""

    def feed(self, text: str) -> Delta:
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> Delta:
        self._run(final=True)
        if self._phase in (Phase.CALL, Phase.ARGUMENT, Phase.JSON, Phase.AFTER_JSON):  # a call never completed
            self._out.content += self._pending
            self._pending, self._call, self._phase = "", None, Phase.PLAIN
        return self._take()

    def _take(self) -> Delta:
        out, self._out = self._out, Delta()
        return out

    # --- scanning --------------------------------------------------------------------------------------

    def _run(self, final: bool) -> None:
        while self._buf:
            if self._phase is Phase.CUT:
                self._buf = ""
                return
            if self._phase is Phase.PLAIN:
                self._out.content += self._buf
                self._buf = ""
                return
            buf = self._buf
            i = buf.find("<|")
            if i != 0:
                j = len(buf) if i < 0 else i
                if i < 0 and not final and buf.endswith("<"):
                    j -= 1  # may start a marker
                if j == 0:
                    return
                self._step_text(buf[:j])
                continue
            head = next((h for h in _HEADS if buf.startswith(h)), None)
            if head is None:
                if self._phase is Phase.DONE and buf.startswith(END_OF_MSG):
                    self._buf = buf[len(END_OF_MSG):]
                    continue
                if not final and any(h.startswith(buf) for h in (*_HEADS, END_OF_MSG)):
                    return  # a marker head still arriving
                self._step_text("<|")
                continue
            k = buf.find("<|", len(head))
            if k < 0 or not buf.startswith(XTML_SEP, k):
                if not final and (k < 0 or XTML_SEP.startswith(buf[k:])):
                    return  # the marker's body or its <|sep|> still arriving
                self._fail(len(buf) if k < 0 else k)
                continue
            end = k + len(XTML_SEP)
            raw, body = buf[:end], buf[len(head):k]
            self._buf = buf[end:]
            try:
                self._marker(head == XTML_OPEN, body, raw)
            except _Malformed:
                self._buf = raw + self._buf
                self._fail(len(raw))

    def _step_text(self, text: str) -> None:
        self._buf = self._buf[len(text):]
        if self._phase is Phase.THINK:
            self._out.reasoning += text
            self._pending = ""
        elif self._phase is Phase.RESPONSE:
            self._out.content += text
            self._pending = ""
        elif self._phase in (Phase.ARGUMENT, Phase.JSON):
            assert self._call is not None
            self._call.value += text
            self._pending += text
        elif self._phase in (Phase.TOOLS, Phase.CALL) and not text.strip(" \n\r\t"):
            self._pending += text  # the tool-call grammar allows whitespace between elements
        else:  # text where only markup may stand
            self._buf = text + self._buf
            self._fail(len(text))

    def _fail(self, n: int) -> None:
        """Leave the grammar at the start of the buffer; its first `n` characters caused it."""
        self._out.content += self._pending + self._buf[:n]
        self._buf = self._buf[n:]
        self._pending, self._call, self._phase = "", None, Phase.PLAIN

    # --- markers -----------------------------------------------------------------------------------------

    def _marker(self, is_open: bool, body: str, raw: str) -> None:
        m = _NAME.match(body)
        if m is None:
            raise _Malformed
        name, attrs = m.group(), self._attrs(body[m.end():])
        kind = "open" if is_open else "close"
        nxt = _MOVES.get((self._phase, kind, name))
        if nxt is None or (name == "tools" and not self._tools) or (not is_open and attrs):
            raise _Malformed
        if is_open:
            allowed = (*_REQUIRED_ATTRS.get(name, ()), *_OPTIONAL_ATTRS.get(name, ()))
            if any(a not in attrs for a in _REQUIRED_ATTRS.get(name, ())) or any(a not in allowed for a in attrs):
                raise _Malformed
        if name == "call" and is_open:
            self._call = _Call(attrs["tool"])
        elif name == "argument" and is_open:
            assert self._call is not None
            if attrs["type"] not in ARG_TYPES or any(k == attrs["key"] for k, _ in self._call.args):
                raise _Malformed
            self._call.key, self._call.type, self._call.value = attrs["key"], attrs["type"], ""
        elif name == "argument":
            assert self._call is not None
            value = self._call.value.strip(" \n\r\t") if self._strip else self._call.value
            self._call.args.append((self._call.key, _json_value(self._call.type, value)))
        elif name == "json":
            assert self._call is not None
            if is_open and (self._call.args or attrs.get("type", "object") != "object"):
                raise _Malformed  # the arguments are typed elements or one json element, not both
            if is_open:
                self._call.value = ""
            else:
                self._call.raw = self._call.value
        elif name == "call":
            assert self._call is not None
            self._release(self._call)
            self._call, self._pending = None, ""
        elif name == "think" and not is_open:
            self.reasoning_ended = True
        if is_open or name != "call":  # all markup but a released call's end stays pending
            self._pending += raw
        self._phase = Phase.CUT if name == "call" and not is_open and not self._parallel else nxt

    @staticmethod
    def _attrs(text: str) -> dict[str, str]:
        out: dict[str, str] = {}
        pos = 0
        while pos < len(text):
            m = _ATTR.match(text, pos)
            if m is None or m.group(1) in out:
                raise _Malformed
            out[m.group(1)] = unescape_attr(m.group(2))
            pos = m.end()
        return out

    def _release(self, call: _Call) -> None:
        index = self._calls
        self._calls += 1
        pieces = [orjson.dumps(k).decode() + ":" + v for k, v in call.args]
        calls = self._out.tool_calls
        calls.append(ToolCallDelta(index, call_id(call.name, index), call.name, ""))
        if call.raw is not None:
            calls.append(ToolCallDelta(index, arguments=call.raw))
        elif not pieces:
            calls.append(ToolCallDelta(index, arguments="{}"))
        for n, p in enumerate(pieces):
            calls.append(ToolCallDelta(index, arguments=("{" if n == 0 else ",") + p
                                       + ("}" if n == len(pieces) - 1 else "")))


def _json_value(kind: str, value: str) -> str:
    """The JSON text of one typed argument: strings are raw in the markup, other values JSON."""
    if kind == "string":
        return orjson.dumps(value).decode()
    try:
        v = orjson.loads(value)
    except orjson.JSONDecodeError as e:
        raise _Malformed from e
    ok = {"number": isinstance(v, int | float) and not isinstance(v, bool),
          "integer": isinstance(v, int) and not isinstance(v, bool), "boolean": isinstance(v, bool),
          "null": v is None, "object": isinstance(v, dict), "array": isinstance(v, list)}[kind]
    if not ok:
        raise _Malformed
    return orjson.dumps(v).decode()
