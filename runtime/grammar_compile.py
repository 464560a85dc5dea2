"""What compiling a grammar is, wherever it runs (a compile worker of `runtime.grammar_pool`, or the scheduler's
`runtime.grammar.GrammarBackend`): the grammar a request carries (`GrammarKey`), xgrammar's compiler for a
vocabulary, and the probe that compiles a grammar and refuses one that admits no token. A leaf: the pool and
the backend both import it, and neither imports the other's code here.

xgrammar (and torch with it) is imported on first use only.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.errors import InvalidRequest

if TYPE_CHECKING:
    import xgrammar as xgr

ANY_JSON = "$$ANY$$"  # json_schema value meaning any JSON value (OpenAI json_object), as SGLang spells it
_CPP_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


@dataclass(frozen=True)
class GrammarKey:
    kind: str  # "regex" | "json_schema" | "ebnf"
    source: str

    def digest(self) -> bytes:
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).digest()


def xgrammar_module() -> Any:
    import xgrammar

    return xgrammar


def error_message(e: Exception) -> str:
    """xgrammar's message, its first line without the C++ source location (no internal paths to clients)."""
    text = str(e).strip()
    return _CPP_LOCATION.sub("", text.splitlines()[0] if text else type(e).__name__)


def refusal(key: GrammarKey, e: Exception) -> InvalidRequest:
    return InvalidRequest(f"invalid {key.kind}: {error_message(e)}", param=key.kind)


@dataclass(frozen=True)
class CompilerSetup:
    """What a worker needs to build the same compiler as the scheduler's."""

    vocab: list[bytes]
    vocab_size: int
    stop_ids: list[int]


@dataclass(frozen=True)
class Probed:
    """A grammar that compiled within the budget: what to compile again (`method`: "regex", "ebnf" or
    "builtin_json")."""

    method: str
    text: str


# xgrammar (0.2.9) writes a length-bounded JSON string (minLength / maxLength) as `[^"\\\r\n]{m,n}`: it lets raw
# control characters (U+0000-U+001F) into the string, which strict JSON parsers refuse. Its unbounded strings
# exclude them (`[^\0-\x1f"\\\r\n]`); the bounded ones get the same class here.
_BOUNDED_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\\r\n]'


def json_schema_grammar(schema: str) -> str:
    """The EBNF of a JSON schema, compact (free whitespace would let an untrained model pad the output
    forever), with bounded strings kept to JSON's characters."""
    text = str(xgrammar_module().Grammar.from_json_schema(schema, any_whitespace=False))
    return text.replace(_BOUNDED_STRING_CHARS, _JSON_STRING_CHARS)


def build_compiler(setup: CompilerSetup, threads: int) -> xgr.GrammarCompiler:
    """xgrammar's compiler for the setup's vocabulary, its own cache off (the backend keeps one, in bytes)."""
    xgr = xgrammar_module()
    info = xgr.TokenizerInfo(setup.vocab, xgr.VocabType.RAW, vocab_size=setup.vocab_size,
                             stop_token_ids=setup.stop_ids)
    return xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)


def compile_as(compiler: xgr.GrammarCompiler, method: str, text: str) -> xgr.CompiledGrammar:
    if method == "regex":
        return compiler.compile_regex(text)
    if method == "ebnf":
        return compiler.compile_grammar(text)
    return compiler.compile_builtin_json_grammar()


def probe(compiler: xgr.GrammarCompiler, key: GrammarKey) -> Probed:
    """Compile `key` (in a pool worker) and say what the scheduler is to compile; InvalidRequest if the grammar
    is refused, or admits no token at all (its first mask is empty: no output could ever match it)."""
    try:
        if key.kind == "json_schema":
            method, text = ("builtin_json", "") if key.source == ANY_JSON else ("ebnf", json_schema_grammar(key.source))
        else:
            method, text = key.kind, key.source
        compiled = compile_as(compiler, method, text)
    except Exception as e:
        raise refusal(key, e) from None
    xgr = xgrammar_module()
    mask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask)
    if not bool(mask.any()):
        raise InvalidRequest(f"the {key.kind} matches no output at all", param=key.kind)
    return Probed(method, text)
