"""The grammar that forces a tool call in Kimi-K2's markup (OpenAI's `tool_choice` "required" or a named
function, after a Jinja chat template): xgrammar's `kimi` structural tag (K2's `<|tool_calls_section_begin|>`
format, each call's arguments under its tool's parameter schema), as EBNF for the request's grammar."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# Call indices of at most three digits: an unbounded repeat would let a weak model loop inside the markup.
_INDEX = "[0-9]{1,3}"


def kimi_k2_forcing_grammar(tools: Sequence[Mapping[str, Any]], tool_choice: str | Mapping[str, Any],
                            reasoning: bool, parallel: bool = True) -> str:
    """EBNF of a reply that calls a tool (any for "required", else the named one) and nothing else, after its
    reasoning when `reasoning`. ValueError / RuntimeError when xgrammar refuses a tool's schema."""
    import xgrammar as xgr

    tag = xgr.get_model_structural_tag("kimi", tools=list(tools), tool_choice=tool_choice,  # type: ignore[arg-type]
                                       reasoning="enabled" if reasoning else "disabled", max_whitespace_cnt=1,
                                       parallel_tool_calls=parallel)
    return str(xgr.Grammar.from_structural_tag(_bounded(tag)))


def _bounded(fmt: Any) -> Any:
    """`fmt` with xgrammar's unbounded call index (`\\d+`) bounded."""
    from pydantic import BaseModel
    from xgrammar import structural_tag as st

    if isinstance(fmt, st.RegexFormat) and fmt.pattern == r"\d+":
        return st.RegexFormat(pattern=_INDEX)
    if isinstance(fmt, list):
        return [_bounded(f) for f in fmt]
    if isinstance(fmt, BaseModel):
        return fmt.model_copy(update={k: _bounded(getattr(fmt, k)) for k in type(fmt).model_fields})
    return fmt
