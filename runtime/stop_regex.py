"""Stop regexes (SGLang's `stop_regex`): the output stops where its text first matches one of them, and the text
is trimmed there like a stop string's.

Both sides use this module: the scheduler looks for a match in the tail of the output that can hold one (as for
stop strings, the longest match decides how many tokens: the whole output for an unbounded pattern) and names
its place in the text; the detokenizer trims there and, while streaming, holds back text that a pattern has
begun to match (the `regex` library's partial matching), so no streamed chunk holds a part of the matched text.
A pattern must be valid for Python's `re` (whose parser bounds its match length) and is matched by `regex`, its
superset. A leaf: no torch.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import regex

from runtime.errors import InvalidRequest

MAX_PATTERNS = 32  # SGLang's limits
MAX_PATTERN_BYTES = 256
UNBOUNDED = -1  # a pattern whose match has no length bound (the scheduler then reads the whole output)


def check_stop_regex(value: Any) -> list[str]:
    """A pattern or a list of them: each a non-empty string that compiles, within SGLang's limits."""
    patterns = [value] if isinstance(value, str) else value
    if not isinstance(patterns, list | tuple) or not all(isinstance(p, str) and p for p in patterns):
        raise InvalidRequest(f"stop_regex must be a non-empty string or a list of them, got {value!r}",
                             param="stop_regex")
    if len(patterns) > MAX_PATTERNS:
        raise InvalidRequest(f"at most {MAX_PATTERNS} stop_regex patterns, got {len(patterns)}", param="stop_regex")
    for p in patterns:
        if len(p.encode()) > MAX_PATTERN_BYTES:
            raise InvalidRequest(f"a stop_regex pattern is {len(p.encode())} bytes, over the {MAX_PATTERN_BYTES}-byte "
                                 "limit", param="stop_regex")
        try:
            max_chars(p)
            compiled(p)
        except (re.error, regex.error, RecursionError) as e:
            raise InvalidRequest(f"stop_regex {p!r} is not a valid regular expression: {e}",
                                 param="stop_regex") from None
    return list(patterns)


@functools.lru_cache(maxsize=256)
def compiled(pattern: str) -> regex.Pattern[str]:
    return regex.compile(pattern)


@functools.lru_cache(maxsize=256)
def max_chars(pattern: str) -> int:
    """The most characters a match of `pattern` can span, or UNBOUNDED."""
    hi = re._parser.parse(pattern).getwidth()[1]  # type: ignore[attr-defined]
    return UNBOUNDED if hi >= re._constants.MAXREPEAT else int(hi)  # type: ignore[attr-defined]


def window_tokens(patterns: list[str]) -> int | None:
    """How many output tokens at the end can hold a match (one per UTF-8 byte, plus one for the first token's
    leading-space handling, as for stop strings); None: all of them."""
    widths = [max_chars(p) for p in patterns]
    return None if UNBOUNDED in widths else 4 * max(widths) + 1


def first_match(text: str, patterns: list[str], ends_past: int = 0) -> tuple[int, str] | None:
    """(start, pattern) of the match that starts first in `text` (the first pattern listed on a tie); with
    `ends_past`, of those that end past that index (a match in the text before it does not count)."""
    hits = [(m.start(), i) for i, p in enumerate(patterns) if (m := _match(compiled(p), text, ends_past)) is not None]
    if not hits:
        return None
    start, i = min(hits)
    return start, patterns[i]


def _match(pattern: regex.Pattern[str], text: str, ends_past: int) -> regex.Match[str] | None:
    if not ends_past:
        return pattern.search(text)
    return next((m for m in pattern.finditer(text, overlapped=True) if m.end() > ends_past), None)


def partial_start(text: str, patterns: list[str]) -> int:
    """Where the earliest match that `text` ends inside of (one that more text could complete, or a complete one
    that reaches its end, which more text could extend into a longer match from the same start) starts; len(text)
    if none does. Complete matches ending before the end (below min_new_tokens, where they do not stop) are passed
    over, but not a match that starts inside one: the scheduler's search from every start would find it."""
    best = len(text)
    for p in patterns:
        m = next((m for m in compiled(p).finditer(text, partial=True, overlapped=True)
                  if m.partial or m.end() == len(text)), None)
        if m is not None:
            best = min(best, m.start())
    return best
