"""The kimi_k2 tool-call parser (and the <think> reasoning parsers) against hand-written expected replies: whole,
and streamed in every split into two pieces, three pieces at the markers' edges, and one character at a time."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from runtime.tokenizer.k3_reply import ParsedReply, ReplyDelta, ToolCall
from runtime.tokenizer.kimi_k2_parser import KimiK2Parser, parse_kimi_k2

SEC, SEC_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
BEGIN, ARGS, END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def call(header: str, arguments: str) -> str:
    return f"{BEGIN}{header}{ARGS}{arguments}{END}"


@dataclass(frozen=True)
class Case:
    text: str
    want: ParsedReply
    tools: bool = True
    reasoning: str | None = None
    parallel: bool = True


WEATHER = '{"city": "Oslo", "days": 3}'
CASES = {
    "plain": Case("Hello there, <b>bold</b> < not a marker", ParsedReply(
        content="Hello there, <b>bold</b> < not a marker")),
    "one_call": Case(f"{SEC}{call('functions.get_weather:0', WEATHER)}{SEC_END}", ParsedReply(
        tool_calls=[ToolCall("functions.get_weather:0", "get_weather", WEATHER)])),
    "text_then_calls": Case(
        f"Let me check.{SEC} {call('functions.get_weather:0', WEATHER)}\n{call('noop:1', ' {} ')}{SEC_END}",
        ParsedReply(content="Let me check.", tool_calls=[
            ToolCall("functions.get_weather:0", "get_weather", WEATHER), ToolCall("noop:1", "noop", "{}")])),
    "text_after_section": Case(f"{SEC}{call('functions.a-b_c:7', '{}')}{SEC_END} after", ParsedReply(
        content=" after", tool_calls=[ToolCall("functions.a-b_c:7", "a-b_c", "{}")])),
    "parallel_off": Case(
        f"{SEC}{call('functions.a:0', '{}')}{call('functions.b:1', '{}')}{SEC_END}tail",
        ParsedReply(tool_calls=[ToolCall("functions.a:0", "a", "{}")]), parallel=False),
    "bad_json": Case(f"x{SEC}{call('functions.a:0', '{not json')}{SEC_END}", ParsedReply(
        content=f"x{SEC}{call('functions.a:0', '{not json')}{SEC_END}")),
    "not_an_object": Case(f"{SEC}{call('functions.a:0', '[1]')}{SEC_END}", ParsedReply(
        content=f"{SEC}{call('functions.a:0', '[1]')}{SEC_END}")),
    "bad_header_after_good": Case(
        f"{SEC}{call('functions.a:0', '{}')}{call('no index', '{}')}{SEC_END}",
        ParsedReply(content=f"{call('no index', '{}')}{SEC_END}", tool_calls=[ToolCall("functions.a:0", "a", "{}")])),
    "junk_in_section": Case(f"{SEC}oops{call('functions.a:0', '{}')}", ParsedReply(
        content=f"{SEC}oops{call('functions.a:0', '{}')}")),
    "unfinished_call": Case(f"ok{SEC}{BEGIN}functions.a:0{ARGS}{{\"x\":", ParsedReply(
        content=f"ok{SEC}{BEGIN}functions.a:0{ARGS}{{\"x\":")),
    "marker_prefix_at_end": Case("text <|tool_calls_sec", ParsedReply(content="text <|tool_calls_sec")),
    "tools_off": Case(f"{SEC}{call('functions.a:0', '{}')}{SEC_END}", ParsedReply(
        content=f"{SEC}{call('functions.a:0', '{}')}{SEC_END}"), tools=False),
    "think_then_call": Case(f"<think>Oslo, so call it.</think>Sure.{SEC}{call('functions.w:0', '{}')}{SEC_END}",
                            ParsedReply(content="Sure.", reasoning_content="Oslo, so call it.",
                                        tool_calls=[ToolCall("functions.w:0", "w", "{}")]), reasoning="kimi_k2"),
    "think_unclosed": Case("<think>still thinking </thi", ParsedReply(reasoning_content="still thinking </thi"),
                           reasoning="kimi_k2"),
    "no_think": Case("Just an answer <think>", ParsedReply(content="Just an answer <think>", reasoning_content=""),
                     reasoning="kimi_k2"),
    "think_kimi_vl": Case("\u25c1think\u25b7hmm\u25c1/think\u25b7ok", ParsedReply(
        content="ok", reasoning_content="hmm"), reasoning="kimi"),
}


def run(case: Case, pieces: list[str]) -> ParsedReply:
    parser = KimiK2Parser(tools=case.tools, reasoning=case.reasoning, parallel_calls=case.parallel)
    deltas: list[ReplyDelta] = [parser.feed(p) for p in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    reasoning = "".join(d.reasoning for d in deltas)
    calls = [ToolCall(c.id or "", c.name or "", c.arguments) for d in deltas for c in d.tool_calls]
    for k, c in enumerate(c for d in deltas for c in d.tool_calls):
        assert c.index == k  # released whole, in order
    return ParsedReply(content or None, reasoning if reasoning or case.reasoning else None, calls)


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole(name: str) -> None:
    case = CASES[name]
    assert parse_kimi_k2(case.text, tools=case.tools, reasoning=case.reasoning,
                         parallel_calls=case.parallel) == case.want


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_split(name: str) -> None:
    case = CASES[name]
    text = case.text
    assert run(case, list(text)) == case.want
    for i in range(len(text) + 1):
        assert run(case, [text[:i], text[i:]]) == case.want, i
    edges = sorted({i for i in range(len(text) + 1) if i == 0 or i == len(text) or text[i - 1] in "|>" or
                    text[i:i + 1] in ("<", "\u25c1")})
    for i in edges:
        for j in edges:
            if i <= j:
                assert run(case, [text[:i], text[i:j], text[j:]]) == case.want, (i, j)


def test_content_streams_before_the_reply_ends() -> None:
    """Content is released as it comes, holding back only a tail that may begin a section."""
    parser = KimiK2Parser()
    assert parser.feed("Hello <|tool").content == "Hello "
    assert parser.feed("_calls_section_begin|>").content == ""
    d = parser.feed(call("functions.f:0", '{"a": 1}'))
    assert [(c.id, c.name, c.arguments) for c in d.tool_calls] == [("functions.f:0", "f", '{"a": 1}')]
