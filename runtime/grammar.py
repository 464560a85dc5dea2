"""Structured output through xgrammar (SGLang's and vLLM's default grammar backend): requests carrying a
`regex`, `json_schema` or `ebnf` are decoded under a per-request token mask.

The grammar is compiled once per distinct source against the tokenizer (`GrammarCompiler`, with its cache),
in a thread pool, never on the scheduler's step loop: a constrained request waits for its grammar before it
is queued. Each request then owns a `GrammarMatcher` that fills its row of the step's packed token bitmask
(bit t % 32 of word t // 32 set: token t allowed) and accepts every token sampled for it; it can roll back
(xgrammar keeps the whole history) for speculative decoding. `check_grammar` is the syntax check at the
door (no tokenizer, so it is cheap); its message is xgrammar's, without the C++ source location.

xgrammar (and torch with it) is imported on first use only: engines that never see a grammar do not pay for
it at startup.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.errors import InvalidRequest

if TYPE_CHECKING:
    import xgrammar as xgr

    from radixk3.tokenizer import Tokenizer

ANY_JSON = "$$ANY$$"  # json_schema value meaning any JSON value (OpenAI json_object), as SGLang spells it
_CPP_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


@dataclass(frozen=True)
class GrammarKey:
    kind: str  # "regex" | "json_schema" | "ebnf"
    source: str


def _xgr() -> Any:
    import xgrammar

    return xgrammar


def _message(e: Exception) -> str:
    text = str(e).strip()
    return _CPP_LOCATION.sub("", text.splitlines()[0] if text else type(e).__name__)


def _refuse(key: GrammarKey, e: Exception) -> InvalidRequest:
    return InvalidRequest(f"invalid {key.kind}: {_message(e)}", param=key.kind)


def check_grammar(key: GrammarKey) -> None:
    """Parse the grammar without a tokenizer; InvalidRequest naming the field and xgrammar's message."""
    if key.kind == "json_schema" and key.source == ANY_JSON:
        return
    xgr = _xgr()
    parse = {"regex": xgr.Grammar.from_regex, "ebnf": xgr.Grammar.from_ebnf,
             "json_schema": lambda s: xgr.Grammar.from_json_schema(s, any_whitespace=False)}[key.kind]
    try:
        parse(key.source)
    except Exception as e:  # xgrammar raises RuntimeError (and ValueError for some schemas)
        raise _refuse(key, e) from None


# xgrammar (0.2.9) writes a length-bounded JSON string (minLength / maxLength) as `[^"\\\r\n]{m,n}`: it lets raw
# control characters (U+0000-U+001F) into the string, which strict JSON parsers refuse. Its unbounded strings
# exclude them (`[^\0-\x1f"\\\r\n]`); the bounded ones get the same class here.
_BOUNDED_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\\r\n]'


def json_schema_grammar(schema: str) -> str:
    """The EBNF of a JSON schema, compact (free whitespace would let an untrained model pad the output
    forever), with bounded strings kept to JSON's characters."""
    text = str(_xgr().Grammar.from_json_schema(schema, any_whitespace=False))
    return text.replace(_BOUNDED_STRING_CHARS, _JSON_STRING_CHARS)


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._m = _xgr().GrammarMatcher(compiled)

    def fill_mask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 [rows, words] torch bitmask."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False (and no change) if the grammar does not allow it."""
        return bool(self._m.accept_token(token))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative drafts)."""
        self._m.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing more may be generated."""
        return bool(self._m.is_terminated())


def mask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def fill_masks(matchers: Sequence[GrammarMatcher]) -> np.ndarray:
    """The packed bitmask of the constrained rows of a step: int32 [len(matchers), words]."""
    if not matchers:
        return np.zeros((0, 0), dtype=np.int32)
    import torch

    mask = torch.empty(len(matchers), mask_words(matchers[0].vocab_size), dtype=torch.int32)
    for i, m in enumerate(matchers):
        m.fill_mask(mask, i)
    return mask.numpy()


class GrammarBackend:
    """The compiler (built on first use from the tokenizer) and the thread pool that runs it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int], threads: int = 2) -> None:
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(f"model vocab {vocab_size} < tokenizer vocab {tokenizer.vocab_size}")
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_ids = sorted(stop_ids)
        self._threads = threads
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")

    def _compiler_now(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                tok = self._tokenizer
                # Each id's bytes as the project decodes them; special ids decode to nothing, which xgrammar
                # takes as "special": never allowed, except the stop ids once the grammar is complete. Ids
                # past the tokenizer's vocabulary (the model's padding) are never allowed either.
                vocab = [tok.token_bytes(i, skip_special_tokens=True) for i in range(tok.vocab_size)]
                info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                         stop_token_ids=self._stop_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._threads, cache_enabled=True)
            return self._compiler

    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        c = self._compiler_now()
        try:
            if key.kind == "regex":
                return c.compile_regex(key.source)
            if key.kind == "ebnf":
                return c.compile_grammar(key.source)
            if key.source == ANY_JSON:
                return c.compile_builtin_json_grammar()
            return c.compile_grammar(json_schema_grammar(key.source))
        except Exception as e:
            raise _refuse(key, e) from None

    def submit(self, key: GrammarKey) -> Future[xgr.CompiledGrammar]:
        return self._pool.submit(self.compile, key)

    def matcher(self, compiled: xgr.CompiledGrammar) -> GrammarMatcher:
        return GrammarMatcher(compiled, self.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
