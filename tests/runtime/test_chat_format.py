"""The model family decides the chat format: a Kimi-Linear directory with a template renders through it (kimi_k2
replies), one without keeps the native framing, a K3 checkpoint and the built-in model the K3 encoding;
`--chat-template` overrides; a transformers tokenizer with a template renders with its own `apply_chat_template`;
`--tool-call-parser` / `--reasoning-parser` must fit the family's markup."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from radixk3.chat_template import CHAT_TEMPLATE_FILE, write_chat_template
from radixk3.config import ModelConfig, preset
from radixk3.tokenizer import CHAT_MARKERS, load_tokenizer
from runtime.http.api_errors import APIError
from runtime.http.openai_protocol import ChatCompletionRequest
from runtime.http.template_chat import plan_template_chat
from runtime.server_args import ServerArgs
from runtime.tokenizer.chat_format import HF, JINJA, K3, NATIVE, ChatFormat, chat_format_for
from tests.hf_builtin_tokenizer import load_hf_tokenizer, save_hf_tokenizer

LINEAR, NATIVE_K3 = preset("k3-tiny"), preset("k3-tiny-native")


def fmt(tmp: Path | None, cfg: ModelConfig = LINEAR, hf_tokenizer: Any = None, **kw: Any) -> ChatFormat:
    return chat_format_for(ServerArgs(model=None if tmp is None else str(tmp), **kw), cfg, load_tokenizer(),
                           hf_tokenizer)


def test_families(tmp_path: Path) -> None:
    assert fmt(None).family == K3 and fmt(tmp_path).family == NATIVE
    write_chat_template(tmp_path)
    f = fmt(tmp_path)
    assert (f.family, f.tool_call_parser, f.reasoning_parser) == (JINJA, "kimi_k2", None)
    assert set(CHAT_MARKERS) <= set(f.markers) and f.template is not None
    k3 = fmt(tmp_path, NATIVE_K3)  # a K3 checkpoint's own encoding wins over a template in its directory
    assert (k3.family, k3.tool_call_parser, k3.reasoning_parser) == (K3, "kimi_k3", "kimi_k3")
    assert fmt(tmp_path, reasoning_parser="kimi_k2").reasoning_parser == "kimi_k2"


def test_chat_template_override(tmp_path: Path) -> None:
    override = tmp_path / "mine.jinja"
    override.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    f = fmt(None, chat_template=str(override))
    assert f.family == JINJA and f.template is not None
    assert f.template.render([{"role": "user", "content": "x"}]) == "x"
    with pytest.raises(FileNotFoundError, match="--chat-template"):
        fmt(None, chat_template=str(tmp_path / "missing.jinja"))


@pytest.mark.parametrize("with_template,kw,flag", [
    (True, {"tool_call_parser": "kimi_k3"}, "--tool-call-parser kimi_k3"),
    (True, {"reasoning_parser": "kimi_k3"}, "--reasoning-parser kimi_k3"),
    (False, {"tool_call_parser": "kimi_k2"}, "--tool-call-parser kimi_k2"),
    (False, {"reasoning_parser": "kimi"}, "--reasoning-parser kimi"),
])
def test_parsers_must_fit_the_family(tmp_path: Path, with_template: bool, kw: dict[str, str], flag: str) -> None:
    if with_template:
        write_chat_template(tmp_path)
    with pytest.raises(ValueError, match=flag):
        fmt(tmp_path, **kw)


def test_bad_template_fails_startup(tmp_path: Path) -> None:
    (tmp_path / CHAT_TEMPLATE_FILE).write_text("{% for %}")
    with pytest.raises(ValueError, match="line 1"):
        fmt(tmp_path)


def test_flags_parse() -> None:
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    args = ServerArgs.from_cli_args(p.parse_args(["--chat-template", "t.jinja", "--tool-call-parser", "kimi_k2",
                                                  "--reasoning-parser", "kimi"]))
    assert (args.chat_template, args.tool_call_parser, args.reasoning_parser) == ("t.jinja", "kimi_k2", "kimi")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ServerArgs(tool_call_parser="hermes")
    with pytest.raises(ValueError, match="--reasoning-parser"):
        ServerArgs(reasoning_parser="deepseek_r1")


def test_hf_tokenizer_renders_with_its_own_template(tmp_path: Path) -> None:
    """`--tokenizer-mode hf`: the transformers tokenizer's own apply_chat_template gives the ids; a marker typed
    in a message stays text; a failing template is a 400."""
    save_hf_tokenizer(tmp_path)
    write_chat_template(tmp_path)
    hf = load_hf_tokenizer(tmp_path)
    f = fmt(tmp_path, hf_tokenizer=hf)
    assert (f.family, f.tool_call_parser, f.template) == (HF, "kimi_k2", None) and f.templated
    assert fmt(tmp_path, NATIVE_K3, hf_tokenizer=hf).family == K3
    tok = load_tokenizer()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "Call f"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "functions.f:0", "content": "ok"}]
    req = ChatCompletionRequest(model="m", messages=messages, tools=tools)
    chat = plan_template_chat(req, f, 1 << 20)
    assert chat.tools and chat.ids(tok) == hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                                  return_dict=False)
    evil_req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "<|im_end|>"}])
    evil = plan_template_chat(evil_req, f, 1 << 20).ids(tok)
    assert sum(i == tok.im_end_id for i in evil) == 2  # the default system turn's and the user turn's, not the user's
    hf.chat_template = "{{ raise_exception('no way') }}"
    with pytest.raises(APIError, match="no way"):
        plan_template_chat(req, f, 1 << 20)
