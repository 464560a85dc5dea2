"""`@function` programs: `run` (optionally streamed), `run_batch` (a thread pool, results in order), and the
default backend."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import tqdm

from frontend_lang.backend import Backend
from frontend_lang.executor import StreamExecutor
from frontend_lang.ir import SamplingParams, defaults
from frontend_lang.state import ProgramState

_default_backend: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Backend | None:
    return _default_backend


def _backend(backend: Backend | None) -> Backend:
    b = backend if backend is not None else _default_backend
    if b is None:
        raise RuntimeError("no backend: pass backend=... or call set_default_backend(Runtime(...) or "
                           "RuntimeEndpoint(url)) first")
    return getattr(b, "endpoint", b)  # SGLang's Runtime objects carry their backend as .endpoint


class SglFunction:
    def __init__(self, func: Callable[..., Any], bind_arguments: dict[str, Any] | None = None) -> None:
        self.func = func
        self.bind_arguments = dict(bind_arguments or {})

    def bind(self, **kwargs: Any) -> SglFunction:
        """The same program with some arguments fixed."""
        return SglFunction(self.func, self.bind_arguments | kwargs)

    def __call__(self, s: ProgramState, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        """Call the program on an existing state (one program appending through another)."""
        if not isinstance(s, ProgramState):
            raise TypeError("call a program on a ProgramState, or use .run(...) / .run_batch(...)")
        return self.func(s, *args, **(self.bind_arguments | kwargs))

    def run(self, *args: Any, max_new_tokens: int = 128, min_new_tokens: int = 0,
            stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
            temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
            frequency_penalty: float = 0.0, presence_penalty: float = 0.0, ignore_eos: bool = False,
            return_logprob: bool = False, logprob_start_len: int | None = None,
            top_logprobs_num: int | None = None, stream: bool = False, backend: Backend | None = None,
            **kwargs: Any) -> ProgramState:
        """Run the program; the sampling arguments are defaults every `gen` may override. A backend error
        raises BackendError with the server's message. With `stream=True` it returns at once: read the state
        with `text_iter()` (errors raise there)."""
        sp = defaults(max_new_tokens, min_new_tokens, stop, stop_token_ids, temperature, top_p, top_k, min_p,
                      frequency_penalty, presence_penalty, ignore_eos, return_logprob, logprob_start_len,
                      top_logprobs_num)
        return self._run(args, kwargs, sp, stream, _backend(backend))

    def _run(self, args: Sequence[Any], kwargs: dict[str, Any], sp: SamplingParams, stream: bool,
             backend: Backend) -> ProgramState:
        exe = StreamExecutor(backend, sp, stream)
        state = ProgramState(exe)
        kwargs = self.bind_arguments | kwargs
        if not stream:
            try:
                state.ret_value = self.func(state, *args, **kwargs)
            finally:
                exe.end()
            exe.sync()
            return state

        def body() -> None:
            try:
                state.ret_value = self.func(state, *args, **kwargs)
            except BaseException as e:  # raised to the reader by text_iter
                exe.fail(e)
            finally:
                exe.end()

        threading.Thread(target=body, daemon=True, name="frontend-lang-program").start()
        return state

    def run_batch(self, batch_kwargs: Sequence[dict[str, Any]], *, max_new_tokens: int = 128,
                  min_new_tokens: int = 0, stop: str | list[str] | None = None,
                  stop_token_ids: list[int] | None = None, temperature: float = 1.0, top_p: float = 1.0,
                  top_k: int = -1, min_p: float = 0.0, frequency_penalty: float = 0.0,
                  presence_penalty: float = 0.0, ignore_eos: bool = False, return_logprob: bool = False,
                  logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                  backend: Backend | None = None, num_threads: int | str = "auto",
                  progress_bar: bool = False) -> list[ProgramState]:
        """Run the program once per kwargs dict, `num_threads` at a time; states in the order of the inputs.
        The first program that fails (in input order) raises once all have run."""
        if not batch_kwargs:
            return []
        if not all(isinstance(kw, dict) for kw in batch_kwargs):
            raise TypeError("run_batch takes a list of keyword-argument dicts, one per program run")
        if num_threads == "auto":
            num_threads = max(96, multiprocessing.cpu_count() * 16)  # SGLang's choice: programs mostly wait
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be a positive int or 'auto', got {num_threads!r}")
        sp = defaults(max_new_tokens, min_new_tokens, stop, stop_token_ids, temperature, top_p, top_k, min_p,
                      frequency_penalty, presence_penalty, ignore_eos, return_logprob, logprob_start_len,
                      top_logprobs_num)
        b = _backend(backend)
        with ThreadPoolExecutor(min(num_threads, len(batch_kwargs))) as pool, \
                tqdm.tqdm(total=len(batch_kwargs), disable=not progress_bar) as bar:
            futures = [pool.submit(self._run, (), dict(kw), sp, False, b) for kw in batch_kwargs]
            for f in futures:
                f.add_done_callback(lambda _: bar.update())
            wait(futures)
        return [f.result() for f in futures]

def function(func: Callable[..., Any] | None = None, **_options: Any) -> Any:  # noqa: ANN401
    """`@function` or `@function(...)`: make `func(s, ...)` a program (`.run`, `.run_batch`)."""
    if func is None:
        return lambda f: SglFunction(f)
    return SglFunction(func)
