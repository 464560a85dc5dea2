"""A checkpoint's own Jinja chat template, rendered the way transformers' `apply_chat_template` renders it.

The template comes from the model directory as transformers finds it: `chat_template.jinja` (and named ones in
`additional_chat_templates/NAME.jinja`), else `tokenizer_config.json`'s `chat_template` (a string, or a list of
`{"name", "template"}`); a set of named templates gives "tool_use" to a request with tools, else "default". It is
rendered in jinja2's immutable sandbox with transformers' environment: `trim_blocks`, `lstrip_blocks`, the
`loopcontrols` extension and the `{% generation %}` tag, `tojson` as transformers defines it (no HTML escaping,
`indent` / `separators` / `sort_keys`), the globals `raise_exception`, `strftime_now`, `dict` and a `namespace`
that refuses underscore names, and the variables `messages`, `tools`, `documents`, `add_generation_prompt`, the
named special tokens of `tokenizer_config.json` (`bos_token`, `eos_token` ...) and the request's
`chat_template_kwargs`. Messages are passed as transformers passes them: keys whose value is None dropped, earlier
reasoning also under `reasoning_content` and `thinking`.

Prompt injection: transformers encodes the whole rendered string, so a `<|im_end|>` typed by a user would close
the turn. `ChatTemplate.prompt` renders with every control marker inside the caller's strings (messages, tools,
documents, kwargs; not dict keys) wrapped in two private-use characters, then cuts the rendered text there: the
template's own markers become `ChatPrompt` markers (special ids), the wrapped ones stay text. This is transformers'
`sanitize_control_tokens=True` scheme; on inputs without marker strings the prompt is the rendered text exactly,
and its ids are transformers' ids (`tests/radixk3/test_chat_template.py` checks both against transformers).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from radixk3.chat_prompt import ChatPrompt

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# The template radixk3 writes with a Kimi-Linear-format checkpoint (make-checkpoint): Kimi's published one.
KIMI_TEMPLATE = Path(__file__).parent / "assets" / "kimi_chat_template.jinja"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
RESERVED_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Wrap a control marker found in a caller's string (supplementary private use area: never in a vocabulary's markers).
_START, _END = "\U000f8ff0", "\U000f8ff1"


class ChatTemplateError(ValueError):
    """The template refused a request or failed on it (`raise_exception`, an undefined value, a type error):
    the request's to fix, an HTTP 400 naming the problem."""


@dataclass(frozen=True)
class ChatTemplate:
    templates: Mapping[str, str]  # name -> Jinja source; a single template is "default"
    special_tokens: Mapping[str, str] = field(default_factory=dict)  # bos_token, eos_token ... as transformers passes
    origin: str = ""  # where it was read, for messages

    def source(self, has_tools: bool) -> str:
        """The template transformers picks: "tool_use" for a request with tools when there is one, else "default"."""
        if has_tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ChatTemplateError(f"the chat template of {self.origin} has no default among its named templates "
                                f"{sorted(self.templates)}")

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
               kwargs: Mapping[str, Any] | None = None) -> str:
        """The rendered text, as transformers' `apply_chat_template(..., tokenize=False)` gives it."""
        kwargs = dict(kwargs or {})
        if clash := sorted(set(kwargs) & set(RESERVED_VARIABLES)):
            raise ChatTemplateError(f"chat_template_kwargs may not set {clash}: the request's own fields set them")
        template = _compile(self.source(tools is not None))
        try:
            return template.render(messages=_template_messages(messages), tools=_plain(tools),
                                   documents=_plain(documents), add_generation_prompt=add_generation_prompt,
                                   **{**self.special_tokens, **_plain(kwargs)})
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e.message or type(e).__name__}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
            raise ChatTemplateError(f"chat template failed on this request: {type(e).__name__}: {e}") from None

    def prompt(self, messages: Sequence[Mapping[str, Any]], *, markers: Sequence[str],
               tools: Sequence[Mapping[str, Any]] | None = None, documents: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, kwargs: Mapping[str, Any] | None = None,
               continue_final_message: bool = False) -> ChatPrompt:
        """The rendered prompt, the template's `markers` (the tokenizer's control markers, `control_markers`) as
        markers and every marker string that came from the caller's values as text. With `continue_final_message`
        the prompt ends right after the final message's content, left open for the reply to continue (as
        transformers' `apply_chat_template` cuts it)."""
        cut = _Cutter(tuple(markers))
        marked = cut.mark(messages)
        text = self.render(marked, tools=cut.mark(tools), documents=cut.mark(documents),
                           add_generation_prompt=add_generation_prompt and not continue_final_message,
                           kwargs=cut.mark(kwargs))
        if continue_final_message:
            text = _cut_after_final(text, marked[-1] if marked else {})
        return cut.split(text)


def _cut_after_final(text: str, final: Mapping[str, Any]) -> str:
    """The rendered text up to the end of the final message's content (stripped, as templates often trim it)."""
    content = final.get("content")
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    content = str(content or "").strip()
    at = text.rfind(content) if content else -1
    if at < 0:
        raise ChatTemplateError("continue_final_message: the final message's content is empty or the chat template "
                                "does not write it as it is")
    return text[:at + len(content)]


class HFChatTokenizer(Protocol):
    """A transformers tokenizer (`--tokenizer-mode hf`, possibly the checkpoint's own class with
    `--trust-remote-code`): its own `apply_chat_template` renders and encodes."""

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            **kwargs: Any) -> Any: ...


def hf_chat_ids(tokenizer: HFChatTokenizer, messages: Sequence[Mapping[str, Any]], *,
                tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
                kwargs: Mapping[str, Any] | None = None, continue_final_message: bool = False) -> list[int]:
    """The ids of the tokenizer's own `apply_chat_template(..., tokenize=True)`: the template's markers are its
    special ids; markers in the caller's strings are text (transformers' `sanitize_control_tokens`)."""
    kwargs = dict(kwargs or {})
    if continue_final_message:  # transformers refuses it beside a generation prompt
        kwargs["continue_final_message"], add_generation_prompt = True, False
    if clash := sorted(set(kwargs) & {*RESERVED_VARIABLES, "tokenize", "return_dict", "sanitize_control_tokens"}):
        raise ChatTemplateError(f"chat_template_kwargs may not set {clash}: the request's own fields set them")
    try:
        ids = tokenizer.apply_chat_template(
            _template_messages(messages), tools=_plain(tools), add_generation_prompt=add_generation_prompt,
            tokenize=True, return_dict=False, sanitize_control_tokens=True, **_plain(kwargs))
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template: {e.message or type(e).__name__}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
        raise ChatTemplateError(f"chat template failed on this request: {type(e).__name__}: {e}") from None
    return [int(i) for i in ids]


def control_markers(tokenizer: Any) -> tuple[str, ...]:
    """The strings a tokenizer reads as one special id (`encode` of the string is that id): the markers a template
    may write. (Control pieces that encoding never produces from text, like sentencepiece's `</s>`, are left out.)"""
    out = []
    for i in sorted(tokenizer.special_ids):
        text = tokenizer.decode([i], skip_special_tokens=False)
        if text and tokenizer.encode(text) == [i]:
            out.append(text)
    return tuple(out)


def load_chat_template(model: str | Path | None, override: str | Path | None = None) -> ChatTemplate | None:
    """The chat template of the checkpoint at `model`, or the file `override` (`--chat-template`); None when
    there is neither. A template that does not parse is a ValueError naming the file and line."""
    config = _tokenizer_config(model)
    special = {k: _token_text(config[k]) for k in SPECIAL_TOKEN_NAMES if config.get(k) is not None}
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(f"--chat-template {override}: no such file")
        templates, origin = {"default": path.read_text(encoding="utf-8")}, str(path)
    elif model is None:
        return None
    else:
        templates, origin = _templates_in(Path(model), config)
    if not templates:
        return None
    for name, source in templates.items():
        try:
            _compile(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{origin}: chat template {name!r} line {e.lineno}: {e.message}") from None
    return ChatTemplate(templates, special, origin)


def write_chat_template(out_dir: str | Path) -> Path:
    """Write Kimi's chat template into a checkpoint directory as `chat_template.jinja` (what transformers saves)."""
    out = Path(out_dir) / CHAT_TEMPLATE_FILE
    shutil.copyfile(KIMI_TEMPLATE, out)
    return out


# --- reading the files ---------------------------------------------------------------------------------


def _tokenizer_config(model: str | Path | None) -> dict[str, Any]:
    if model is None or not (path := Path(model) / TOKENIZER_CONFIG_FILE).is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken object with its content."""
    return str(value["content"]) if isinstance(value, dict) else str(value)


def _templates_in(model: Path, config: Mapping[str, Any]) -> tuple[dict[str, str], str]:
    """The files win over tokenizer_config.json, as in transformers."""
    templates: dict[str, str] = {}
    if (file := model / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = file.read_text(encoding="utf-8")
    if (extra := model / CHAT_TEMPLATE_DIR).is_dir():
        templates |= {f.stem: f.read_text(encoding="utf-8") for f in sorted(extra.glob("*.jinja"))}
    if templates:
        return templates, str(model)
    raw = config.get("chat_template")
    origin = str(model / TOKENIZER_CONFIG_FILE)
    if isinstance(raw, str):
        return {"default": raw}, origin
    if isinstance(raw, list):
        try:
            return {t["name"]: t["template"] for t in raw}, origin
        except (TypeError, KeyError):
            raise ValueError(f"{origin}: chat_template is a list but not of {{name, template}} objects") from None
    if raw is not None:
        raise ValueError(f"{origin}: chat_template must be a string or a list of named templates")
    return {}, origin


# --- the environment -----------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant tokens with it): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without handing them the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore-prefixed names (a way towards CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's signature trick: `namespace(self=...)` works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the underscore name {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_Namespace)
    return env.from_string(source)


# --- the template's inputs -----------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """Plain JSON data (str, int, float, bool, None, dict, list): all a template gets to see."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise TypeError(f"chat template input of type {type(value).__name__}")


def _template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        msg = {k: _plain(v) for k, v in m.items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


class _Cutter:
    """Marks the control markers in a caller's strings, then cuts the rendered text into a `ChatPrompt`."""

    def __init__(self, markers: tuple[str, ...]) -> None:
        alternatives = "|".join(map(re.escape, sorted(markers, key=len, reverse=True))) or "(?!)"
        self._markers = re.compile(f"({alternatives})")
        self._marked = re.compile(f"{_START}({alternatives}){_END}|[{_START}{_END}]")

    def mark(self, value: Any) -> Any:
        if isinstance(value, str):
            # Markers already in the string are dropped first, so that none can be forged.
            value = value.replace(_START, "").replace(_END, "")
            return self._markers.sub(lambda m: f"{_START}{m.group(0)}{_END}", value)
        if isinstance(value, Mapping):
            return {k: self.mark(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mark(v) for v in value]
        return value

    def split(self, text: str) -> ChatPrompt:
        parts: list[ChatPrompt | str] = []
        # [template text, marked marker or None (a lone wrapping character the template split off), ...]
        for i, piece in enumerate(self._marked.split(text)):
            if not piece:
                continue
            if i % 2:
                parts.append(ChatPrompt.plain(piece))
                continue
            for k, run in enumerate(self._markers.split(piece)):
                parts.append(ChatPrompt.marker(run) if k % 2 else run)
        return ChatPrompt.join(parts)
