"""Incremental parser of what a Kimi-Linear / Kimi-K2 model writes after its Jinja chat template: reasoning in
`<think>...</think>` (the reasoning parser `kimi_k2`; `kimi` is Kimi-VL's `◁think▷...◁/think▷`, as SGLang spells
them), content, and tool calls in K2's markup (the tool-call parser `kimi_k2`, SGLang's `kimik2_detector`):

    <|tool_calls_section_begin|>
      <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON object}<|tool_call_end|> ...
    <|tool_calls_section_end|>

Whitespace may stand between the markers. A call's id is its header as written (`functions.NAME:IDX`, what Kimi's
template writes back for an assistant turn's call), its name the header less `functions.` and `:IDX`.

Feed the model's text (special tokens kept) in pieces of any size; each `feed` returns what became certain, as
the K3 parser does (`runtime.tokenizer.k3_stream_parser`), in the same types (`runtime.tokenizer.k3_reply`).
Reasoning is only the text between an opening marker at the very start of the reply and its close. Content
streams, holding back only a tail that may begin a section. A call is released whole at its end marker (name and
arguments in one delta), so a call that turns out malformed was never half sent. Malformed markup does not fail:
from the point where the text leaves the grammar, the raw text (with the section or call it interrupted) becomes
content. With parallel calls off (OpenAI's `parallel_tool_calls: false`) the reply ends at its first call: the
text after it is dropped. One machine serves the streamed and the whole parse, so the deltas of any split of a
text add up to the parse of the whole text.
"""

from __future__ import annotations

import re
from enum import Enum, auto

import orjson

from runtime.tokenizer.k3_reply import CallDelta, ParsedReply, ReplyDelta, ToolCall

TOOL_CALLS_BEGIN = "<|tool_calls_section_begin|>"
TOOL_CALLS_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENTS_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
# Reasoning parsers: name -> (open, close).
THINK_MARKERS = {"kimi_k2": ("<think>", "</think>"), "kimi": ("\u25c1think\u25b7", "\u25c1/think\u25b7")}
_HEADER = re.compile(r"\s*((?:functions\.)?([A-Za-z0-9_-]+):\d+)\s*" + re.escape(ARGUMENTS_BEGIN) + r"(.*)", re.S)


class _Phase(Enum):
    THINK_START = auto()  # may the reply open with reasoning? (only with a reasoning parser)
    THINK = auto()
    CONTENT = auto()
    SECTION = auto()  # between the calls of a section
    CALL = auto()
    PLAIN = auto()  # left the grammar: everything from here is content
    CUT = auto()  # past the one call allowed: everything from here is dropped


def _held_back(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (it may yet become the marker)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class KimiK2Parser:
    """One reply: `feed` its text in pieces, `finish` at its end. `reasoning`: a key of `THINK_MARKERS` or None;
    `tools`: parse tool calls (else the markup is content)."""

    def __init__(self, *, tools: bool = True, reasoning: str | None = None, parallel_calls: bool = True) -> None:
        self._tools = tools
        self._think = THINK_MARKERS[reasoning] if reasoning is not None else None
        self._parallel = parallel_calls
        self._phase = _Phase.THINK_START if self._think is not None else _Phase.CONTENT
        self._buf = ""
        self._searched = 0  # how much of the buffer is known to hold no whole CALL_END (a call's body streams)
        self._held = ""  # raw markup consumed since the last certain point (section start or released call)
        self._calls = 0

    def feed(self, text: str) -> ReplyDelta:
        self._buf += text
        content: list[str] = []
        reasoning: list[str] = []
        calls: list[CallDelta] = []
        while self._step(content, reasoning, calls):
            pass
        return ReplyDelta("".join(content), "".join(reasoning), tuple(calls))

    def finish(self) -> ReplyDelta:
        """What the end of the text makes certain: held-back text, an unfinished call as content."""
        rest, self._buf = self._buf, ""
        phase, held, self._held = self._phase, self._held, ""
        self._phase = _Phase.CUT
        if phase is _Phase.THINK:
            return ReplyDelta(reasoning=rest)
        if phase in (_Phase.SECTION, _Phase.CALL):
            return ReplyDelta(content=held + rest)
        return ReplyDelta(content="" if phase is _Phase.CUT else rest)

    # One move of the machine; False when it needs more text.
    def _step(self, content: list[str], reasoning: list[str], calls: list[CallDelta]) -> bool:
        buf, phase = self._buf, self._phase
        if not buf:
            return False
        if phase is _Phase.THINK_START:
            assert self._think is not None
            opening = self._think[0]
            if buf.startswith(opening):
                self._take(len(opening))
                self._phase = _Phase.THINK
                return True
            if opening.startswith(buf):
                return False
            self._phase = _Phase.CONTENT
            return True
        if phase is _Phase.THINK:
            assert self._think is not None
            closing = self._think[1]
            if (i := buf.find(closing)) >= 0:
                reasoning.append(buf[:i])
                self._take(i + len(closing))
                self._phase = _Phase.CONTENT
                return True
            keep = _held_back(buf, closing)
            reasoning.append(self._take(len(buf) - keep))
            return False
        if phase is _Phase.CONTENT:
            if not self._tools:
                content.append(self._take(len(buf)))
                return False
            if (i := buf.find(TOOL_CALLS_BEGIN)) >= 0:
                content.append(self._take(i))
                self._held = self._take(len(TOOL_CALLS_BEGIN))
                self._phase = _Phase.SECTION
                return True
            content.append(self._take(len(buf) - _held_back(buf, TOOL_CALLS_BEGIN)))
            return False
        if phase is _Phase.SECTION:
            body = buf.lstrip()
            for marker, nxt in ((CALL_BEGIN, _Phase.CALL), (TOOL_CALLS_END, _Phase.CONTENT)):
                if body.startswith(marker):
                    self._held += self._take(len(buf) - len(body) + len(marker))
                    self._phase = nxt
                    if nxt is _Phase.CONTENT:
                        self._held = ""
                    return True
            if not body or CALL_BEGIN.startswith(body) or TOOL_CALLS_END.startswith(body):
                return False
            return self._leave_grammar(content)
        if phase is _Phase.CALL:
            if (i := buf.find(CALL_END, max(0, self._searched - len(CALL_END) + 1))) < 0:
                self._searched = len(buf)  # a long argument is searched once, not again with every token
                return False
            body = buf[:i]
            call = self._call(body)
            if call is None:
                return self._leave_grammar(content)
            self._take(i + len(CALL_END))
            calls.append(call)
            self._held = ""
            self._calls += 1
            self._phase = _Phase.SECTION if self._parallel else _Phase.CUT
            return True
        if phase is _Phase.PLAIN:
            content.append(self._take(len(buf)))
            return False
        self._take(len(buf))  # CUT
        return False

    def _call(self, body: str) -> CallDelta | None:
        m = _HEADER.fullmatch(body)
        if m is None:
            return None
        arguments = m.group(3).strip()
        try:
            parsed = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(parsed, dict):
            return None
        return CallDelta(self._calls, m.group(1), m.group(2), arguments)

    def _leave_grammar(self, content: list[str]) -> bool:
        content.append(self._held + self._take(len(self._buf)))
        self._held = ""
        self._phase = _Phase.PLAIN
        return False

    def _take(self, n: int) -> str:
        out, self._buf = self._buf[:n], self._buf[n:]
        self._searched = 0
        return out


class KimiK2Reply:
    """A reply put together from the parser's deltas (`push` chunk by chunk, `reply()` at any point), as
    `runtime.tokenizer.k3_reply.ReplyAssembler` does for K3."""

    def __init__(self, *, tools: bool = True, reasoning: str | None = None, parallel_calls: bool = True) -> None:
        self._parser = KimiK2Parser(tools=tools, reasoning=reasoning, parallel_calls=parallel_calls)
        self._reasoning_on = reasoning is not None
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[ToolCall] = []

    def push(self, text: str, final: bool = False) -> ReplyDelta:
        deltas = [self._parser.feed(text)]
        if final:
            deltas.append(self._parser.finish())
        d = ReplyDelta("".join(x.content for x in deltas), "".join(x.reasoning for x in deltas),
                       tuple(c for x in deltas for c in x.tool_calls))
        self._content.append(d.content)
        self._reasoning.append(d.reasoning)
        self._calls += [ToolCall(c.id or "", c.name or "", c.arguments) for c in d.tool_calls]
        return d

    def reply(self) -> ParsedReply:
        content, reasoning = "".join(self._content), "".join(self._reasoning)
        return ParsedReply(content=content or None,
                           reasoning_content=reasoning if reasoning or self._reasoning_on else None,
                           tool_calls=list(self._calls))

    def finish_reason(self, finished: str | None) -> str | None:
        """OpenAI's: a reply that stopped after calling tools finished for "tool_calls"."""
        return "tool_calls" if finished == "stop" and self._calls else finished


def parse_kimi_k2(text: str, *, tools: bool = True, reasoning: str | None = None,
                  parallel_calls: bool = True) -> ParsedReply:
    """The whole reply `text` (special tokens kept) as OpenAI's message fields."""
    reply = KimiK2Reply(tools=tools, reasoning=reasoning, parallel_calls=parallel_calls)
    reply.push(text, final=True)
    return reply.reply()
