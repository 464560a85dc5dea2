"""`ProgramState` (the `s` a program appends to) and `ProgramStateGroup` (what `s.fork(n)` returns)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from frontend_lang.executor import StreamExecutor
from frontend_lang.ir import CommitPrefix, Expr, Join, RoleBegin, RoleEnd, _role, as_expr


class ProgramState:
    def __init__(self, executor: StreamExecutor) -> None:
        self.stream_executor = executor
        self.ret_value: Any = None

    def __iadd__(self, other: Expr | str) -> ProgramState:
        self.stream_executor.submit(as_expr(other))
        return self

    # --- values (each waits for the expressions it depends on) -----------------------------------------
    def __getitem__(self, name: str) -> Any:  # noqa: ANN401
        return self.stream_executor.get_var(name)

    def get_var(self, name: str) -> Any:  # noqa: ANN401
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:  # noqa: ANN401
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str) -> dict[str, Any] | None:
        """The backend's meta_info of gen `name` (prompt/completion/cached tokens, finish reason), or the
        per-choice scores of select `name`."""
        self.stream_executor.get_var(name)
        return self.stream_executor.meta_info.get(name)

    def text(self) -> str:
        self.stream_executor.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, str]]:
        self.stream_executor.sync()
        return list(self.stream_executor.messages_)

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> BaseException | None:
        return self.stream_executor.error_

    # --- roles -----------------------------------------------------------------------------------------
    def _role(self, role: str, expr: Expr | str | None) -> Any:  # noqa: ANN401
        if expr is not None:
            self += _role(role, expr)
            return None
        return self._role_scope(role)

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self += RoleBegin(role)
        yield
        self += RoleEnd(role)

    def system(self, expr: Expr | str | None = None) -> Any:  # noqa: ANN401
        return self._role("system", expr)

    def user(self, expr: Expr | str | None = None) -> Any:  # noqa: ANN401
        return self._role("user", expr)

    def assistant(self, expr: Expr | str | None = None) -> Any:  # noqa: ANN401
        return self._role("assistant", expr)

    # --- fork --------------------------------------------------------------------------------------------
    def fork(self, size: int = 1) -> ProgramStateGroup:
        """`size` branches that continue from this state. With more than one, the text so far is first
        cached on the backend (one `max_new_tokens: 0` request), so the branches' requests hit it."""
        exe = self.stream_executor
        if size > 1:
            exe.submit(CommitPrefix())
        exe.sync()
        return ProgramStateGroup([ProgramState(exe.forked()) for _ in range(int(size))], self)

    @contextmanager
    def copy(self) -> Iterator[ProgramState]:
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    # --- streaming ---------------------------------------------------------------------------------------
    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text as it is produced (with `run(..., stream=True)`): of the whole state, or of one variable.
        Without streaming, the finished text in one piece."""
        exe = self.stream_executor
        if not exe.stream:
            yield self.text() if var_name is None else str(self.get_var(var_name))
            return
        if var_name is None:
            yield from self._iter(lambda: exe.text_, lambda: exe.finished)
            exe.raise_error()
            return
        exe.wait_for(lambda: var_name in exe.variables or exe.finished)
        exe.raise_error()
        if var_name not in exe.variables:
            raise KeyError(f"no variable {var_name!r} in this program state")
        yield from self._iter(lambda: str(exe.variables[var_name]), lambda: exe.var_done(var_name) or exe.finished)
        exe.raise_error()

    def _iter(self, current: Any, done: Any) -> Iterator[str]:  # noqa: ANN401
        exe = self.stream_executor
        sent = 0
        while True:
            exe.wait_for(lambda n=sent: len(current()) > n or done())
            text, over = current(), done()
            if len(text) > sent:
                yield text[sent:]
                sent = len(text)
            if over:
                return

    def __repr__(self) -> str:
        return f"ProgramState({self.stream_executor.text_!r})"


class ProgramStateGroup:
    """Forked branches: index them, append to all at once, and `join` them back."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self.parent = parent

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Expr | str | list[Expr | str]) -> ProgramStateGroup:
        """The same expression to every branch, or one per branch from a list."""
        if isinstance(other, list):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} branches")
            for s, e in zip(self.states, other, strict=True):
                s += e
        else:
            for s in self.states:
                s += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """`gather_variable`: each variable the branches set becomes, in the parent, the list of their values;
        `concate_and_append`: the branches' own text is appended to the parent, in order."""
        for s in self.states:
            s.sync()
        if mode == "gather_variable":
            exes = [s.stream_executor for s in self.states]
            for n in sorted({n for e in exes for n in e.new_vars}):
                self.parent.set_var(n, [e.variables.get(n) for e in exes])
        elif mode == "concate_and_append":
            self.parent += Join([s.stream_executor for s in self.states])
        else:
            raise ValueError(f"unknown join mode {mode!r}; expected 'gather_variable' or 'concate_and_append'")
