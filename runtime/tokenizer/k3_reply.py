"""A K3 assistant reply put together from the parser's deltas: the one place that assembles content, reasoning
and tool calls, chunk by chunk for a stream (`ReplyAssembler.push`) or whole (`parse_reply`). The HTTP layer
only maps what it gives to OpenAI's types (`runtime.http.k3_chat`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from radixk3.tokenizer import Tokenizer
from runtime.tokenizer.k3_stream_parser import K3StreamParser
from runtime.tokenizer.k3_tools import RESPONSE_PREFIX, THINK_PREFIX


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclass
class ParsedReply:
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class CallDelta:
    """What one chunk adds to one call: its first carries id and name, then argument fragments follow."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class ReplyDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[CallDelta, ...] = ()  # one entry per call the chunk touches, as OpenAI streams them


class ReplyAssembler:
    """One reply that continues `prefix`: `push` its text in pieces of any size (`final` with the last),
    read `reply()` at any point. `forced`: written under `k3_tools.forcing_grammar`; `parallel` off: at most
    one call (OpenAI's `parallel_tool_calls: false`; the parser drops the text after the first call)."""

    def __init__(self, prefix: str = RESPONSE_PREFIX, *, tools: bool = True, forced: bool = False,
                 parallel: bool = True) -> None:
        self._parser = K3StreamParser(prefix, tools=tools, strip_strings=forced, parallel_calls=parallel)
        self._thinking = prefix == THINK_PREFIX
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, tuple[str, str, list[str]]] = {}  # index -> id, name, argument fragments

    def push(self, text: str, final: bool = False) -> ReplyDelta:
        deltas = [self._parser.feed(text)]
        if final:
            deltas.append(self._parser.finish())
        content = "".join(d.content for d in deltas)
        reasoning = "".join(d.reasoning for d in deltas)
        self._content.append(content)
        self._reasoning.append(reasoning)
        merged: dict[int, CallDelta] = {}
        for t in (t for d in deltas for t in d.tool_calls):
            if t.name is not None:
                self._calls[t.index] = (t.id or "", t.name, [])
            self._calls[t.index][2].append(t.arguments)
            got = merged.get(t.index)
            merged[t.index] = (CallDelta(t.index, t.id, t.name, t.arguments) if got is None
                               else CallDelta(t.index, got.id, got.name, got.arguments + t.arguments))
        return ReplyDelta(content, reasoning, tuple(merged.values()))

    def reply(self) -> ParsedReply:
        content, reasoning = "".join(self._content), "".join(self._reasoning)
        return ParsedReply(
            content=content or None,
            reasoning_content=reasoning if reasoning or self._thinking else None,
            tool_calls=[ToolCall(cid, name, "".join(args)) for cid, name, args in
                        (self._calls[i] for i in sorted(self._calls))],
        )

    def finish_reason(self, finished: str | None) -> str | None:
        """OpenAI's: a reply that stopped after calling tools finished for "tool_calls"."""
        return "tool_calls" if finished == "stop" and self._calls else finished


def parse_reply(text: str, prefix: str = RESPONSE_PREFIX, *, tools: bool = True, forced: bool = False,
                parallel: bool = True) -> ParsedReply:
    """The whole reply `text` (markers kept) that continues `prefix`, as OpenAI's message fields."""
    assembler = ReplyAssembler(prefix, tools=tools, forced=forced, parallel=parallel)
    assembler.push(text, final=True)
    return assembler.reply()


def without_stop_text(tok: Tokenizer, text: str, ids: Sequence[int]) -> str:
    """A finished output's text less its stop token's own text (`<|im_end|>` would read as stray content)."""
    if ids and ids[-1] in tok.stop_ids:
        return text.removesuffix(tok.decode(ids[-1:], skip_special_tokens=False))
    return text
