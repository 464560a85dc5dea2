"""How a model's chats are written and read: the one place that chooses the renderer and the reply parsers.

The model family decides: a Kimi-Linear-format checkpoint whose directory has a Jinja chat template (or any model
given `--chat-template PATH`, as SGLang and vLLM spell it) renders through that template
(`radixk3.chat_template`) and reads replies with the `kimi_k2` tool-call parser; one without a template keeps the
native Kimi framing, with K3's markup (XTML) for tools and thinking; a K3-format checkpoint and the built-in model
use K3's own encoding (`runtime.tokenizer.k3_encoding`). With a transformers tokenizer (`--tokenizer-mode hf`, the
checkpoint's own class under `--trust-remote-code`) that carries a template, its own
`apply_chat_template(..., tokenize=True)` renders and encodes (family HF, read as JINJA's). `--tool-call-parser`
and `--reasoning-parser` (SGLang's names) default to the family's and must fit the family's markup: K2's
`<|tool_calls_section_begin|>` format after a Jinja template (`kimi_k2`; reasoning `kimi_k2` for `<think>`, `kimi`
for `◁think▷`, none by default: Instruct models do not think), K3's XTML otherwise (`kimi_k3` for both).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixk3.builtin_model import checkpoint_dir, random_preset
from radixk3.chat_template import ChatTemplate, HFChatTokenizer, control_markers, load_chat_template
from radixk3.config import ModelConfig
from radixk3.tokenizer import Tokenizer
from runtime.server_args import ServerArgs

JINJA, HF, NATIVE, K3 = "jinja", "hf", "native", "k3"
_TOOL_PARSERS = {JINJA: ("kimi_k2",), HF: ("kimi_k2",), NATIVE: ("kimi_k3",), K3: ("kimi_k3",)}
_REASONING_PARSERS = {JINJA: ("kimi_k2", "kimi"), HF: ("kimi_k2", "kimi"), NATIVE: ("kimi_k3",), K3: ("kimi_k3",)}
_DEFAULT_REASONING = {JINJA: None, HF: None, NATIVE: "kimi_k3", K3: "kimi_k3"}


@dataclass(frozen=True)
class ChatFormat:
    family: str  # JINJA: the checkpoint's template; HF: the transformers tokenizer's; NATIVE: radixk3's Kimi
    # framing; K3: the K3 encoding
    template: ChatTemplate | None  # with JINJA
    markers: tuple[str, ...]  # the tokenizer's control markers: the template's own become special ids
    tool_call_parser: str
    reasoning_parser: str | None
    hf: HFChatTokenizer | None = None  # with HF

    @property
    def templated(self) -> bool:
        """Rendered by a Jinja template (radixk3's renderer or the transformers tokenizer's)."""
        return self.family in (JINJA, HF)


def chat_format_for(args: ServerArgs, cfg: ModelConfig, tokenizer: Tokenizer,
                    hf_tokenizer: HFChatTokenizer | None = None) -> ChatFormat:
    """The model's chat format; ValueError for a template that does not parse or a parser that does not fit.
    `hf_tokenizer`: the transformers tokenizer `--tokenizer-mode hf` loaded, if any."""
    hf = None
    if hf_tokenizer is not None and args.chat_template is None and not cfg.is_k3_format:
        hf = hf_tokenizer if getattr(hf_tokenizer, "chat_template", None) is not None else None
    template = None
    if hf is None and (args.chat_template is not None or not cfg.is_k3_format):
        template = load_chat_template(checkpoint_dir(args.model), args.chat_template)
    # The random test presets are K3 (the built-in tokenizer has K3's markers), though k3-tiny's config is written
    # in Kimi-Linear's format.
    k3 = cfg.is_k3_format or random_preset(args.model) is not None
    family = HF if hf is not None else JINJA if template is not None else K3 if k3 else NATIVE
    tool_parser = args.tool_call_parser or _TOOL_PARSERS[family][0]
    if tool_parser not in _TOOL_PARSERS[family]:
        raise ValueError(f"--tool-call-parser {tool_parser} does not read what this model's {_WRITER[family]} "
                         f"prompts for; use {' or '.join(_TOOL_PARSERS[family])}")
    reasoning = args.reasoning_parser or _DEFAULT_REASONING[family]
    if reasoning is not None and reasoning not in _REASONING_PARSERS[family]:
        raise ValueError(f"--reasoning-parser {reasoning} does not read what this model's {_WRITER[family]} "
                         f"prompts for; use {' or '.join(_REASONING_PARSERS[family])}")
    markers = control_markers(tokenizer) if template is not None else ()
    return ChatFormat(family, template, markers, tool_parser, reasoning, hf)


_WRITER = {JINJA: "Jinja chat template", HF: "transformers chat template",
           NATIVE: "native Kimi framing (K3 markup for tools)", K3: "K3 encoding"}
