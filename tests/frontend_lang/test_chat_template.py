"""The K3 roles write K3's messages exactly as its chat encoding does (thinking off), text and ids; the
assistant's gen is told to stop at the marker that closes the response."""

from __future__ import annotations

import pytest

from frontend_lang.chat_template import K3
from radixk3.chat_prompt import ChatPrompt
from radixk3.tokenizer import XTML_CLOSE, load_tokenizer
from runtime.tokenizer.k3_encoding import K3ChatOptions, render_k3_chat

TURNS = [("system", "Be brief."), ("user", "How many <|open|> clips?"), ("assistant", " 72"), ("user", "Why?")]


def test_k3_roles_equal_the_encoding() -> None:
    tok = load_tokenizer()
    prompt = ChatPrompt.join(K3.prefix(r) + c + K3.suffix(r) for r, c in TURNS) + K3.prefix("assistant")
    want = render_k3_chat([{"role": r, "content": c} for r, c in TURNS], None, K3ChatOptions(thinking=False))
    assert prompt.text == want.text
    assert prompt.ids(tok, add_bos=K3.add_bos) == want.ids(tok)
    assert K3.stop_markers("assistant") == (XTML_CLOSE,) and K3.stop_markers("user") == ()
    with pytest.raises(ValueError, match="unsupported chat role"):
        K3.prefix("tool")
