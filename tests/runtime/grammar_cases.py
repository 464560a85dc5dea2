"""Grammars the structured-output tests run through the Engine, HTTP and the frontend: each bounds its output,
so that even the random-weight model finishes it within a few dozen tokens."""

from __future__ import annotations

from typing import Any

REGEXES = [
    r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    r"(yes|no|maybe)( because [a-z]{1,8})?",
    r"[A-Z][a-z]{0,6}@[a-z]{1,5}\.(com|org)",
]
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"], "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}},
]
EBNF = 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9] | [1-9][0-9]'
EBNF_AS_REGEX = r"\((\d|[1-9]\d)(\+(\d|[1-9]\d))*\)"
MAX_NEW_TOKENS = 64  # every grammar above ends well within this
