"""Runs one program state's expressions in order, on a worker thread, so that `s += gen(...)` returns at once
and forked branches (and the programs of `run_batch`) send their requests concurrently.

A worker thread exists only while expressions are queued. The first failure (a backend error, a nested
role) is kept; the expressions after it are skipped and every later sync point raises it.

The state's text is also kept as a `ChatPrompt` (`prompt_`): the role markup's markers apart from everything
else (the program's strings, generated text, chosen choices), which backends that tokenise encode as text.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from frontend_lang.backend import Backend
from frontend_lang.ir import (
    CommitPrefix,
    Expr,
    ExprList,
    Gen,
    Image,
    Join,
    RoleBegin,
    RoleEnd,
    SamplingParams,
    Select,
    Text,
)
from radixk3.chat_prompt import ChatPrompt
from radixk3.vision.prompt import placeholder


class StreamExecutor:
    def __init__(self, backend: Backend, defaults: SamplingParams, stream: bool) -> None:
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.template = backend.chat_template
        self.text_ = ""
        self.prompt_ = ChatPrompt()  # text_, with the role markup's markers kept apart
        self.messages_: list[dict[str, str]] = []
        self.images_: list[str] = []  # one per image placeholder in prompt_, in order
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.cur_role: str | None = None
        self.role_begin_pos = 0
        self.fork_start = 0  # where a forked branch's own text begins
        self.fork_images = 0  # ... and its own images
        self.new_vars: set[str] = set()  # variables set by this state itself (not inherited at a fork)
        self.error_: BaseException | None = None
        self.ended = False  # the program function has returned
        self._cond = threading.Condition()
        self._queue: deque[Expr] = deque()
        self._unfinished = 0
        self._running = False
        self._expected: set[str] = set()  # variables that queued expressions will set
        self._done: set[str] = set()

    # --- the queue -------------------------------------------------------------------------------------
    def submit(self, expr: Expr) -> None:
        with self._cond:
            if self.ended:
                raise RuntimeError("the program has returned; its state takes no more expressions")
            names = _names(expr)
            self._expected.update(names)
            self._done.difference_update(names)  # a name set again is pending until the new value lands
            self._queue.append(expr)
            self._unfinished += 1
            if not self._running:
                self._running = True
                threading.Thread(target=self._drain, daemon=True, name="frontend-lang-executor").start()

    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._running = False
                    return
                expr = self._queue.popleft()
                failed = self.error_ is not None
            try:
                if not failed:
                    self._execute(expr)
            except BaseException as e:  # kept, and raised at the next sync point of the program's thread
                with self._cond:
                    self.error_ = e
            finally:
                with self._cond:
                    self._unfinished -= 1
                    self._cond.notify_all()

    def sync(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._unfinished == 0)
        self.raise_error()

    def raise_error(self) -> None:
        if self.error_ is not None:
            raise self.error_

    def end(self) -> None:
        with self._cond:
            self.ended = True
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if self.error_ is None:
                self.error_ = error
            self._cond.notify_all()

    @property
    def finished(self) -> bool:
        return (self.ended and self._unfinished == 0) or self.error_ is not None

    def var_done(self, name: str) -> bool:
        return name in self._done

    def forked(self) -> StreamExecutor:
        """A branch that starts from this state's text, messages and variables (after a sync)."""
        b = StreamExecutor(self.backend, self.defaults, self.stream)
        b.text_, b.prompt_, b.messages_ = self.text_, self.prompt_, list(self.messages_)
        b.images_ = list(self.images_)
        b.fork_images = len(self.images_)
        b.variables, b.meta_info = dict(self.variables), dict(self.meta_info)
        b.cur_role, b.role_begin_pos = self.cur_role, self.role_begin_pos
        b.fork_start = len(self.text_)
        b._done = set(self._done)
        return b

    def wait_for(self, predicate: Any) -> None:  # noqa: ANN401
        with self._cond:
            self._cond.wait_for(predicate)

    def get_var(self, name: str) -> Any:  # noqa: ANN401
        with self._cond:
            if name not in self._expected and name not in self._done:
                raise KeyError(f"no variable {name!r} in this program state")
            self._cond.wait_for(lambda: name in self._done or self.error_ is not None)
        self.raise_error()
        return self.variables[name]

    def set_var(self, name: str, value: Any) -> None:  # noqa: ANN401
        with self._cond:
            self.variables[name] = value
            self._done.add(name)
            self.new_vars.add(name)
            self._cond.notify_all()

    # --- execution (on the worker thread) --------------------------------------------------------------
    def _fill(self, text: ChatPrompt | str) -> None:
        """Append text (a string) or the role markup (a ChatPrompt)."""
        with self._cond:
            self.prompt_ += text
            self.text_ += text if isinstance(text, str) else text.text
            self._cond.notify_all()

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, Text):
            self._fill(expr.value)
        elif isinstance(expr, Image):
            with self._cond:
                self.images_.append(expr.data)
            self._fill(placeholder())
        elif isinstance(expr, ExprList):
            for item in expr.items:
                self._execute(item)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            if self.images_:
                raise ValueError("select after an image is not supported (gen is)")
            decision = self.backend.select(self.prompt_, expr.choices, expr.method)
            self._fill(decision.decision)
            with self._cond:
                self.meta_info[expr.name] = decision.meta_info
            self.set_var(expr.name, decision.decision)
        elif isinstance(expr, RoleBegin):
            if self.cur_role is not None:
                raise ValueError(f"role {expr.role!r} begins inside role {self.cur_role!r}: roles do not nest")
            prefix = self.template.prefix(expr.role)
            self.cur_role = expr.role
            self._fill(prefix)
            self.role_begin_pos = len(self.text_)
        elif isinstance(expr, RoleEnd):
            if self.cur_role != expr.role:
                raise ValueError(f"role {expr.role!r} ends, but the open role is {self.cur_role!r}")
            content = self.text_[self.role_begin_pos :].lstrip()
            self._fill(self.template.suffix(expr.role))
            self.cur_role = None
            with self._cond:
                self.messages_.append({"role": expr.role, "content": content})
        elif isinstance(expr, CommitPrefix):
            if self.text_ and not self.images_:  # a prefix with images is cached by the requests that carry them
                self.backend.cache_prefix(self.prompt_)
        elif isinstance(expr, Join):
            for branch in expr.branches:
                branch.sync()
                with self._cond:
                    self.images_.extend(branch.images_[branch.fork_images:])
                self._fill(branch.prompt_.after(branch.fork_start))
        else:
            raise TypeError(f"unknown expression {type(expr).__name__}")

    def _gen(self, expr: Gen) -> None:
        sampling, options = self.defaults.merged(expr.params).to_request()
        if self.images_:
            options = options | {"image_data": list(self.images_)}
        if self.cur_role is not None and (stops := self.template.stop_markers(self.cur_role)):
            sampling["stop_token_ids"] = [*sampling.get("stop_token_ids", []), *self.backend.marker_ids(stops)]
        name = expr.name
        if not self.stream:
            text, meta = self.backend.generate(self.prompt_, sampling, options)
            self._fill(text)
            with self._cond:
                self.meta_info[name] = meta
            self.set_var(name, text)
            return
        prompt = self.prompt_
        with self._cond:
            self.variables[name] = ""
            self._cond.notify_all()
        for delta, meta in self.backend.generate_stream(prompt, sampling, options):
            with self._cond:
                self.text_ += delta
                self.prompt_ += delta
                self.variables[name] += delta
                self.meta_info[name] = meta
                self._cond.notify_all()
        self.set_var(name, self.variables[name])


def _names(expr: Expr) -> list[str]:
    if isinstance(expr, Gen | Select):
        return [expr.name]
    if isinstance(expr, ExprList):
        return [n for e in expr.items for n in _names(e)]
    return []
