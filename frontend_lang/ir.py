"""The expressions a program appends to its state (`s += ...`): text, `image`, `gen`, `select`, role begin/end.

Names and arguments follow SGLang's `sglang.lang.api`, so an SGLang program runs after changing its import.
"""

from __future__ import annotations

import base64
import io
import itertools
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from frontend_lang.choices import ChoicesSamplingMethod, token_length_normalized

_anonymous = itertools.count()


@dataclass
class SamplingParams:
    """Sampling settings of one `gen`; None means "the program's default" (from `run(...)`)."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    regex: str | None = None
    json_schema: str | None = None
    # Request options, not sampling parameters: they travel beside `sampling_params`.
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None

    # Unset fields are left out of requests, so `regex` / `json_schema` reach the engine only when given.
    REQUEST_OPTIONS = ("return_logprob", "logprob_start_len", "top_logprobs_num")

    def merged(self, override: SamplingParams) -> SamplingParams:
        """These defaults with every field `override` sets."""
        out = SamplingParams(**{f.name: getattr(self, f.name) for f in fields(self)})
        for f in fields(override):
            if (v := getattr(override, f.name)) is not None:
                setattr(out, f.name, v)
        return out

    def to_request(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(sampling_params, request options) in the native API's shape."""
        sampling: dict[str, Any] = {}
        options: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if f.name in self.REQUEST_OPTIONS:
                options[f.name] = v
            else:
                sampling[f.name] = list(v) if isinstance(v, list | tuple) else v
        return sampling, options


def defaults(max_new_tokens: int = 128, min_new_tokens: int = 0, stop: str | list[str] | None = None,
             stop_token_ids: list[int] | None = None, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
             min_p: float = 0.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
             ignore_eos: bool = False, return_logprob: bool = False, logprob_start_len: int | None = None,
             top_logprobs_num: int | None = None) -> SamplingParams:
    """The program-wide sampling defaults `run` / `run_batch` take (SGLang's defaults)."""
    return SamplingParams(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                          stop=[] if stop is None else stop, stop_token_ids=stop_token_ids or [],
                          temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                          frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                          ignore_eos=ignore_eos, return_logprob=return_logprob or None,
                          logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num)


class Expr:
    """Something a program appends to its state."""

    def __add__(self, other: Expr | str) -> ExprList:
        return ExprList([self, as_expr(other)])

    def __radd__(self, other: Expr | str) -> ExprList:
        return ExprList([as_expr(other), self])


@dataclass
class Text(Expr):
    value: str


@dataclass
class Image(Expr):
    """An image in the prompt (a model with a vision tower): base64 text, a data: or http(s) URL (sent as it is)."""

    data: str


@dataclass
class ExprList(Expr):
    items: list[Expr]


@dataclass
class Gen(Expr):
    name: str
    params: SamplingParams


@dataclass
class Select(Expr):
    name: str
    choices: list[str]
    method: ChoicesSamplingMethod
    temperature: float = 0.0


@dataclass
class RoleBegin(Expr):
    role: str


@dataclass
class RoleEnd(Expr):
    role: str


@dataclass
class CommitPrefix(Expr):
    """Cache the state's text so far on the backend (a `max_new_tokens: 0` request): what `fork` does first."""


@dataclass
class Join(Expr):
    """Append the text each branch added after the fork (`join("concate_and_append")`)."""

    branches: list[Any] = field(default_factory=list)


def as_expr(x: Expr | str) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, str):
        return Text(x)
    raise TypeError(f"a program appends str or frontend_lang expressions, not {type(x).__name__}")


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
        stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, frequency_penalty: float | None = None, presence_penalty: float | None = None,
        ignore_eos: bool | None = None, return_logprob: bool | None = None, logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None, regex: str | None = None, json_schema: str | None = None,
        choices: list[str] | None = None, choices_method: ChoicesSamplingMethod | None = None) -> Gen | Select:
    """Generate text into variable `name`; with `choices`, the same as `select`."""
    if choices is not None:
        return select(name, choices, temperature or 0.0, choices_method or token_length_normalized)
    params = SamplingParams(max_new_tokens=max_tokens, min_new_tokens=min_tokens, stop=stop,
                            stop_token_ids=stop_token_ids, temperature=temperature, top_p=top_p, top_k=top_k,
                            min_p=min_p, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                            ignore_eos=ignore_eos, regex=regex, json_schema=json_schema,
                            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                            top_logprobs_num=top_logprobs_num)
    return Gen(name if name is not None else f"_gen_{next(_anonymous)}", params)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> Select:
    """Append the choice the model scores highest (by `choices_method`) and store it in variable `name`."""
    if not choices:
        raise ValueError("select needs a non-empty list of choices")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select's choices must be non-empty strings")
    if temperature > 1e-5:
        raise ValueError("select scores choices greedily: temperature must be 0")
    return Select(name if name is not None else f"_select_{next(_anonymous)}", list(choices), choices_method,
                  temperature)


def image(expr: str | os.PathLike[str] | bytes | Any) -> Image:  # noqa: ANN401
    """An image at this point of the prompt, as SGLang's `sgl.image`: a file path, bytes, a PIL image, base64 text,
    or a data: / http(s) URL; the image goes with every later request of the state."""
    if isinstance(expr, str) and expr.startswith(("data:", "http://", "https://")):
        return Image(expr)
    if isinstance(expr, os.PathLike) or (isinstance(expr, str) and os.path.isfile(expr)):
        expr = Path(expr).read_bytes()
    elif hasattr(expr, "save"):  # a PIL image
        buf = io.BytesIO()
        expr.save(buf, format="PNG")
        expr = buf.getvalue()
    if isinstance(expr, bytes | bytearray):
        return Image(base64.b64encode(expr).decode())
    if isinstance(expr, str):
        return Image(expr)  # base64 text
    raise TypeError(f"sgl.image takes a path, bytes, a PIL image, base64 or a URL, not {type(expr).__name__}")


def _role(role: str, expr: Expr | str | None) -> Expr:
    if expr is None:
        return ExprList([RoleBegin(role), RoleEnd(role)])
    return ExprList([RoleBegin(role), as_expr(expr), RoleEnd(role)])


def system(expr: Expr | str | None = None) -> Expr:
    return _role("system", expr)


def user(expr: Expr | str | None = None) -> Expr:
    return _role("user", expr)


def assistant(expr: Expr | str | None = None) -> Expr:
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
