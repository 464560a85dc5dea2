"""Structured output through xgrammar (SGLang's and vLLM's default grammar backend): requests carrying a
`regex`, `json_schema` or `ebnf` are decoded under a per-request token mask.

At the door (`check_grammar`, in the tokenizer process, no tokenizer needed so it is cheap): the grammar's size
(`--max-grammar-bytes`), a json_schema's depth and unsupported features (`runtime.grammar_schema`), then
xgrammar's parse; messages are xgrammar's, without the C++ source location.

In the scheduler (`GrammarBackend`): each distinct grammar is compiled once against the tokenizer, never on the
step loop, under a time budget (`runtime.grammar_pool` says how: a killable worker process first, then a thread
here). A grammar that admits no token at all is refused there. Compiled grammars stay in an LRU cache bounded
in bytes (`--grammar-cache-bytes`, xgrammar's own estimate of each), emptied by `clear_cache` (the scheduler's
flush); refusals are remembered by digest, so a grammar that timed out is not compiled again. A constrained
request waits for its grammar before it is queued. Each request then owns a `GrammarMatcher` that fills its row
of the step's packed token bitmask (bit t % 32 of word t // 32 set: token t allowed), narrowed to the tokens
that keep the output well-formed UTF-8 (`runtime.grammar_utf8`), and accepts every token sampled for it; it
can roll back (xgrammar keeps the whole history) for speculative decoding.

xgrammar (and torch with it) is imported on first use only: engines that never see a grammar do not pay for
it at startup.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.errors import InvalidRequest
from runtime.grammar_compile import (
    ANY_JSON,
    CompilerSetup,
    GrammarKey,
    Probed,
    build_compiler,
    compile_as,
    error_message,
    refusal,
    xgrammar_module,
)
from runtime.grammar_pool import WORKER_NICE, CompilePool
from runtime.grammar_schema import vet_json_schema
from runtime.grammar_utf8 import REJECT, Utf8Table, Utf8Walk
from runtime.server_args import ServerArgs

if TYPE_CHECKING:
    import xgrammar as xgr

    from radixk3.tokenizer import Tokenizer

REMEMBERED_REFUSALS = 4096  # digests of grammars refused at compile (a timeout would cost a worker again)


def check_grammar(key: GrammarKey, max_bytes: int = ServerArgs.max_grammar_bytes) -> None:
    """Check the grammar without a tokenizer: its size, a schema's depth and features, xgrammar's parse;
    InvalidRequest naming the field and the problem."""
    size = len(key.source.encode())
    if size > max_bytes:
        raise InvalidRequest(f"{key.kind} is {size} bytes, over the limit of {max_bytes} bytes", param=key.kind)
    if key.kind == "json_schema" and key.source == ANY_JSON:
        return
    if key.kind == "json_schema":
        vet_json_schema(key.source)
    xgr = xgrammar_module()
    parse = {"regex": xgr.Grammar.from_regex, "ebnf": xgr.Grammar.from_ebnf,
             "json_schema": lambda s: xgr.Grammar.from_json_schema(s, any_whitespace=False)}[key.kind]
    try:
        parse(key.source)
    except Exception as e:  # xgrammar raises RuntimeError (and ValueError for some schemas)
        raise refusal(key, e) from None


class GrammarMatcher:
    """One request's position in its grammar, and in well-formed UTF-8 (`runtime.grammar_utf8`: xgrammar lets
    encoded surrogates through)."""

    def __init__(self, compiled: xgr.CompiledGrammar, utf8: Utf8Table) -> None:
        self.vocab_size = utf8.next_state.shape[1]
        self._m = xgrammar_module().GrammarMatcher(compiled)
        self._utf8 = Utf8Walk(utf8)

    def fill_mask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 [rows, words] torch bitmask."""
        self._m.fill_next_token_bitmask(bitmask, row)
        bitmask[row] &= self._utf8.mask

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False (and no change) if the grammar does not allow it."""
        state = self._utf8.next(token)
        if state == REJECT or not self._m.accept_token(token):
            return False
        self._utf8.push(state)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative drafts)."""
        self._m.rollback(num_tokens)
        self._utf8.rollback(num_tokens)

    def check_integrity(self) -> None:
        self._utf8.check_integrity()

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


class CompiledCache:
    """Compiled grammars by key, least recently used first out, bounded by xgrammar's estimate of their bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: collections.OrderedDict[GrammarKey, tuple[xgr.CompiledGrammar, int]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: GrammarKey) -> xgr.CompiledGrammar | None:
        hit = self._items.get(key)
        if hit is None:
            return None
        self._items.move_to_end(key)
        return hit[0]

    def put(self, key: GrammarKey, compiled: xgr.CompiledGrammar) -> None:
        size = int(compiled.memory_size_bytes) + len(key.source)
        if key in self._items or size > self.max_bytes:  # one larger than the whole cache is used, not kept
            return
        self._items[key] = (compiled, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, old) = self._items.popitem(last=False)
            self.bytes -= old

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0


def _background_thread() -> None:
    """The compile thread yields its core to the step loop (Linux: a thread's nice value is its own)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)


class GrammarBackend:
    """Compiled grammars for the scheduler: the cache, the worker pool that probes a new grammar under the time
    budget, and the thread that then compiles it here."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int],
                 args: ServerArgs | None = None) -> None:
        """`args`: the --grammar-* settings (default: their defaults)."""
        args = args if args is not None else ServerArgs()
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(f"model vocab {vocab_size} < tokenizer vocab {tokenizer.vocab_size}")
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_ids = sorted(stop_ids)
        self.compile_timeout = args.grammar_compile_timeout
        self._workers = args.grammar_compile_workers
        self.cache = CompiledCache(args.grammar_cache_bytes)
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None
        self._pool: CompilePool | None = None
        self._utf8: Utf8Table | None = None
        self._threads = ThreadPoolExecutor(1, thread_name_prefix="grammar", initializer=_background_thread)
        self._pending: dict[GrammarKey, Future[xgr.CompiledGrammar]] = {}
        self._refused: collections.OrderedDict[bytes, InvalidRequest] = collections.OrderedDict()

    def _started(self) -> CompilePool:
        """The compiler and the pool, built at the first grammar (with the lock held)."""
        if self._pool is None:
            tok = self._tokenizer
            # Each id's bytes as the project decodes them; special ids decode to nothing, which xgrammar
            # takes as "special": never allowed, except the stop ids once the grammar is complete. Ids
            # past the tokenizer's vocabulary (the model's padding) are never allowed either.
            vocab = [tok.token_bytes(i, skip_special_tokens=True) for i in range(tok.vocab_size)]
            setup = CompilerSetup(vocab, self.vocab_size, self._stop_ids)
            self._utf8 = Utf8Table.of(vocab, self.vocab_size)
            self._compiler = build_compiler(setup, threads=1)
            self._pool = CompilePool(setup, self._workers, self.compile_timeout)
        return self._pool

    def submit(self, key: GrammarKey) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar (at once if cached), or InvalidRequest: refused, or not compiled in time."""
        with self._lock:
            out: Future[xgr.CompiledGrammar] = Future()
            if (hit := self.cache.get(key)) is not None:
                out.set_result(hit)
                return out
            if (refusal := self._refused.get(key.digest())) is not None:
                out.set_exception(InvalidRequest(refusal.message, param=refusal.param))
                return out
            if (pending := self._pending.get(key)) is not None:
                return pending
            self._pending[key] = out
            pool = self._started()
        pool.submit(key).add_done_callback(lambda probed: self._on_probed(key, probed, out))
        return out

    def _on_probed(self, key: GrammarKey, probed: Future[Probed], out: Future[xgr.CompiledGrammar]) -> None:
        e = probed.exception()
        if e is None:
            self._threads.submit(self._compile_here, key, probed.result(), out)
            return
        with self._lock:
            self._pending.pop(key, None)
            if isinstance(e, InvalidRequest):
                self._refused[key.digest()] = e
                while len(self._refused) > REMEMBERED_REFUSALS:
                    self._refused.popitem(last=False)
        out.set_exception(e)

    def _compile_here(self, key: GrammarKey, probed: Probed, out: Future[xgr.CompiledGrammar]) -> None:
        try:
            assert self._compiler is not None
            compiled = compile_as(self._compiler, probed.method, probed.text)  # releases the GIL
        except Exception as e:  # the same source compiled in the worker: not the grammar's fault
            with self._lock:
                self._pending.pop(key, None)
            out.set_exception(RuntimeError(f"the {key.kind} failed to compile: {error_message(e)}"))
            return
        with self._lock:
            self._pending.pop(key, None)
            self.cache.put(key, compiled)
        out.set_result(compiled)

    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        return self.submit(key).result()

    def matcher(self, compiled: xgr.CompiledGrammar) -> GrammarMatcher:
        assert self._utf8 is not None, "a matcher for a grammar this backend compiled (which builds the table)"
        return GrammarMatcher(compiled, self._utf8)

    def clear_cache(self) -> None:
        """Forget every compiled grammar and refusal (requests holding a matcher keep theirs alive)."""
        with self._lock:
            self.cache.clear()
            self._refused.clear()

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._pool is not None:
            self._pool.close()
