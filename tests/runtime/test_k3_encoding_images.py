"""K3's encoding of image parts: each becomes `<|media_begin|>image {W}x{H}<|media_content|>` + n x
`<|media_pad|>` + `<|media_end|>` (W x H the original size, n the image's merged tokens), written out here and
encoded segment by segment with the K3 tokenizer radixk3 writes (which has the media markers): the markers their
special ids, the text ordinarily."""

from __future__ import annotations

from functools import cache

import pytest

from radixk3.tiktoken_writer import SPECIAL_OFFSETS, TINY_TIKTOKEN_BASE, write_tiktoken_tokenizer
from radixk3.tokenizer import Tokenizer, load_tokenizer
from radixk3.vision.image_processor import image_grid
from radixk3.vision.prompt import IMAGE_PLACEHOLDER, ImageSlot
from runtime.tokenizer.k3_encoding import K3ChatOptions, RenderError, image_parts, render_k3_chat

OFF = K3ChatOptions(thinking=False)
USER = '<|open|>message role="user"<|sep|>'
EOM = "<|close|>message<|sep|><|end_of_msg|>"
GEN = '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|media_begin|>", "<|media_content|>",
           "<|media_end|>", "<|media_pad|>")


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(write_tiktoken_tokenizer(tmp_path_factory.mktemp("k3_tok")))


@cache
def _pieces(text: str) -> list[tuple[str, bool]]:
    """`text` cut at the markers; the text between them cut as the encoding cuts it (role="user": ` role`, `="`,
    `user`, `"`)."""
    out: list[tuple[str, bool]] = []
    pos = 0
    while pos < len(text):
        marker = next((m for m in MARKERS if text.startswith(m, pos)), None)
        if marker is not None:
            out.append((marker, True))
            pos += len(marker)
            continue
        end = min((i for i in (text.find(m, pos) for m in MARKERS) if i >= 0), default=len(text))
        chunk = text[pos:end]
        if chunk.startswith("message role="):
            role = chunk[len('message role="'):-1]
            out += [("message", False), (" role", False), ('="', False), (role, False), ('"', False)]
        else:
            out.append((chunk, False))
        pos = end
    return out


def special_id(marker: str) -> int:
    """The writer's id for `marker` (its published offset from the base vocabulary)."""
    return TINY_TIKTOKEN_BASE + next(k for k, v in SPECIAL_OFFSETS.items() if v == marker)


def expected_ids(tok: Tokenizer, text: str) -> list[int]:
    ids: list[int] = []
    for piece, special in _pieces(text):
        ids += [special_id(piece)] if special else tok.encode_ordinary(piece)
    return ids


def media(width: int, height: int, n: int) -> str:
    return f"<|media_begin|>image {width}x{height}<|media_content|>" + "<|media_pad|>" * n + "<|media_end|>"


def test_one_image(tok: Tokenizer) -> None:
    grid = image_grid(31, 45)  # 45 x 31 pads to 56 x 56: a 4 x 4 patch grid, 2 x 2 tokens
    n = grid.num_tokens((2, 2))
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": "data:..."}}]}]
    p = render_k3_chat(messages, options=OFF, images=[ImageSlot(45, 31, n)])
    expected = USER + "What is this?" + media(45, 31, n) + EOM + GEN
    assert p.text == expected
    assert p.ids(tok) == expected_ids(tok, expected)
    pad = special_id("<|media_pad|>")
    assert p.ids(tok).count(pad) == n == 4


def test_several_images_in_order(tok: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a"}}, {"type": "text", "text": "and"},
                                     {"type": "image_url", "image_url": {"url": "b"}}]},
        {"role": "assistant", "content": "Two cats."},
        {"role": "user", "content": [{"type": "text", "text": "Now"}, {"type": "image", "image": "c"}]},
    ]
    slots = [ImageSlot(28, 28, 1), ImageSlot(300, 40, 33), ImageSlot(33, 200, 16)]
    assert [p.get("image_url", {}).get("url", p.get("image")) for p in image_parts(messages)] == ["a", "b", "c"]
    p = render_k3_chat(messages, options=OFF, images=slots)
    expected = (USER + media(28, 28, 1) + "and" + media(300, 40, 33) + EOM
                + '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>Two cats.<|close|>response<|sep|>'
                + EOM + USER + "Now" + media(33, 200, 16) + EOM + GEN)
    assert p.text == expected
    assert p.ids(tok) == expected_ids(tok, expected)


def test_placeholder_typed_as_text_stays_text(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": f"see {IMAGE_PLACEHOLDER}"}]
    p = render_k3_chat(messages, options=OFF)
    assert p.text == USER + f"see {IMAGE_PLACEHOLDER}" + EOM + GEN
    assert special_id("<|media_pad|>") not in p.ids(tok)


def test_image_counts_must_agree() -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a"}}]}]
    with pytest.raises(RenderError, match="1 image"):
        render_k3_chat(messages, options=OFF)
    with pytest.raises(RenderError, match="2 given"):
        render_k3_chat(messages, options=OFF, images=[ImageSlot(28, 28, 1)] * 2)
    tool = [{"role": "assistant", "content": "", "tool_calls": [{"id": "1", "function": {"name": "f"}}]},
            {"role": "tool", "tool_call_id": "1", "content": [{"type": "image_url", "image_url": {"url": "a"}}]}]
    with pytest.raises(RenderError, match="tool message"):
        render_k3_chat(tool, options=OFF, images=[ImageSlot(28, 28, 1)])
