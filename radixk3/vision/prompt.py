"""An image's place in the prompt, as K3's encoding writes it: the renderer puts `<|kimi_image_placeholder|>`
where an image part is, and each placeholder becomes

    <|media_begin|>image {W}x{H}<|media_content|><|media_pad|> x n<|media_end|>

with W x H the image's original size and n its merged tokens (`ImageGrid.num_tokens`): the encoder's embedding
rows replace the n pad ids' token embeddings, in order. Markers are special ids; `image {W}x{H}` is text.
Only placeholders the renderer placed (marker segments) expand: one typed in a message stays text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from radixk3.chat_prompt import ChatPrompt, Segment

IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
MEDIA_BEGIN = "<|media_begin|>"
MEDIA_CONTENT = "<|media_content|>"
MEDIA_END = "<|media_end|>"
MEDIA_PAD = "<|media_pad|>"


@dataclass(frozen=True)
class ImageSlot:
    """What the prompt needs of an image (a `ProcessedImage` gives it: `slot`)."""

    width: int
    height: int
    num_tokens: int


def image_prompt(slot: ImageSlot) -> ChatPrompt:
    if slot.num_tokens < 1:
        raise ValueError(f"an image of {slot.num_tokens} tokens")
    pads = ChatPrompt((Segment(MEDIA_PAD, special=True),) * slot.num_tokens)
    return ChatPrompt.join([ChatPrompt.marker(MEDIA_BEGIN), ChatPrompt.piece(f"image {slot.width}x{slot.height}"),
                            ChatPrompt.marker(MEDIA_CONTENT), pads, ChatPrompt.marker(MEDIA_END)])


def placeholder() -> ChatPrompt:
    """The marker a renderer places for an image part."""
    return ChatPrompt.marker(IMAGE_PLACEHOLDER)


def count_placeholders(prompt: ChatPrompt) -> int:
    return sum(1 for s in prompt.segments if s.special and s.text == IMAGE_PLACEHOLDER)


def expand_images(prompt: ChatPrompt, slots: Sequence[ImageSlot]) -> ChatPrompt:
    """`prompt` with its i-th placeholder marker replaced by `image_prompt(slots[i])`; ValueError when the
    counts differ."""
    found = count_placeholders(prompt)
    if found != len(slots):
        raise ValueError(f"the prompt has {found} image(s), {len(slots)} given")
    parts: list[ChatPrompt] = []
    images = iter(slots)
    for s in prompt.segments:
        is_image = s.special and s.text == IMAGE_PLACEHOLDER
        parts.append(image_prompt(next(images)) if is_image else ChatPrompt((s,)))
    return ChatPrompt.join(parts)
