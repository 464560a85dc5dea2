"""K3 tool calling: the reply as the model writes it (`render_reply`, for tests and examples) and the grammar
that forces a call (`runtime.tokenizer.k3_encoding` renders the conversation, `runtime.tokenizer.k3_reply`
assembles the replies).

Forced tool calls (`tool_choice` "required" or named) are constrained by xgrammar's `kimi_k3` structural tag
(the grammar of the whole rest of the reply), handed to the grammar backend as EBNF.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from radixk3.chat_prompt import ChatPrompt
from radixk3.tokenizer import END_OF_MSG, XTML_CLOSE, XTML_OPEN
from runtime.tokenizer.k3_encoding import Call, assistant_body, close_tag, open_tag

# The generation prefixes as the reply parser reads them (the reply's text, markers written out).
THINK_PREFIX, RESPONSE_PREFIX = open_tag("think").text, open_tag("response").text
MESSAGE_END = (close_tag("message") + ChatPrompt.marker(END_OF_MSG)).text


def render_reply(content: str | None, calls: Sequence[tuple[str, Mapping[str, Any] | str]] = (),
                 reasoning: str | None = None) -> str:
    """An assistant reply as the model writes it, from the first channel to the end of the message: after the
    think prefix when `reasoning` is given (blank reasoning too), else after the response prefix. A call's
    arguments given as a string are not JSON: they go in a `json` element."""
    written = [Call(None, n, {}, a) if isinstance(a, str) else Call(None, n, dict(a)) for n, a in calls]
    body = assistant_body(ChatPrompt.piece(content or ""), written, None, thinking=False)
    if reasoning is not None:
        body = open_tag("think") + ChatPrompt.piece(reasoning) + close_tag("think") + body
    return body.text + MESSAGE_END


def forcing_grammar(tools: Sequence[Mapping[str, Any]], tool_choice: str | Mapping[str, Any],
                    thinking: bool, parallel: bool = True) -> str:
    """EBNF of the rest of a reply that must call a tool (any for "required", else the named one), from
    xgrammar's `kimi_k3` structural tag. After the think prefix the reasoning and the response run free (a model
    that thinks ends them); after the response prefix (no thinking) the reply is its calls: the grammar closes
    the response channel the prompt opened, so a forced reply cannot talk instead of calling."""
    import xgrammar as xgr
    from xgrammar import structural_tag as st

    # One whitespace at most where the grammar allows it, and call indices of at most three digits:
    # unbounded repeats would let a weak model loop inside the markup until max_tokens.
    tag = xgr.get_model_structural_tag("kimi_k3", tools=list(tools), tool_choice=tool_choice,  # type: ignore[arg-type]
                                       reasoning="enabled" if thinking else "disabled", max_whitespace_cnt=1,
                                       parallel_tool_calls=parallel)
    elements = list(tag.format.elements)  # type: ignore[union-attr]
    if not thinking:  # the free response text, then its close: only the close
        elements[0] = st.ConstStringFormat(value=close_tag("response").text)
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


def request_grammar_after_thinking(field: str, source: Any) -> str:
    """EBNF of a reply after the think prefix whose reasoning runs free and whose response channel holds what
    a request's own grammar (`field`: json_schema, regex or ebnf) allows; the grammar ends there, as it ends a
    reply without thinking (whose prompt opens the response channel)."""
    import xgrammar as xgr
    from xgrammar import structural_tag as st

    if field == "json_schema":
        inner: Any = st.JSONSchemaFormat(json_schema=source if isinstance(source, str) else dict(source))
    elif field == "regex":
        inner = st.RegexFormat(pattern=source)
    else:
        inner = st.GrammarFormat(grammar=source)
    reasoning = st.TagFormat(begin="", content=st.AnyTextFormat(excludes=[XTML_OPEN, XTML_CLOSE]),
                             end=close_tag("think").text + open_tag("response").text)
    tag = xgr.StructuralTag(format=st.SequenceFormat(elements=[reasoning, inner]))
    return str(xgr.Grammar.from_structural_tag(tag))
