"""A rendered chat prompt that keeps the renderer's control markers apart from text.

A chat renderer writes control markers (`<|im_user|>`, `<|im_end|>`, K3's `<|open|>` ...) and text around them:
its own words (the role word, `result tool="`) and what it was given (messages, names, tool definitions, tool
calls and results, reasoning). Only the markers it placed may become special ids. Text is encoded ordinarily
(`Encoder.encode_ordinary`), so a marker typed by a user stays text and can neither close a turn nor open
tool markup (prompt injection).

Text is encoded in runs from one marker to the next, exactly as the markers cut a whole-string `encode`: a
prompt whose text holds no marker string gets the ids a raw `encode` of its text gives (prefix caching relies on
that; `tests/radixk3/test_chat_prompt.py` checks it). A renderer whose checkpoint encodes each of its pieces on
its own (K3's: `tag`, ` key`, `="`, the value and `"` are separate encodes, so BPE never merges across them)
writes `ChatPrompt.piece`s: a piece is never joined with the text beside it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixk3.tokenizer_base import Encoder


@dataclass(frozen=True)
class Segment:
    text: str
    special: bool  # a control marker the renderer placed (one special id); else text, encoded as text
    alone: bool = False  # text encoded on its own, never in one run with the text beside it


@dataclass(frozen=True)
class ChatPrompt:
    """Segments in order; `+` joins prompts and plain strings (a string is text)."""

    segments: tuple[Segment, ...] = ()

    @staticmethod
    def marker(marker: str) -> ChatPrompt:
        """One control marker, which must be a single special token of the tokenizer that encodes the prompt."""
        return ChatPrompt((Segment(marker, special=True),))

    @staticmethod
    def plain(text: str) -> ChatPrompt:
        return ChatPrompt((Segment(text, special=False),) if text else ())

    @staticmethod
    def piece(text: str) -> ChatPrompt:
        """Text encoded on its own (`Segment.alone`)."""
        return ChatPrompt((Segment(text, special=False, alone=True),) if text else ())

    @staticmethod
    def join(parts: Iterable[ChatPrompt | str]) -> ChatPrompt:
        out: list[Segment] = []
        for p in parts:
            for s in _as_prompt(p).segments:
                if out and not (s.special or s.alone or out[-1].special or out[-1].alone):  # one run anyway
                    out[-1] = Segment(out[-1].text + s.text, special=False)
                else:
                    out.append(s)
        return ChatPrompt(tuple(out))

    def __add__(self, other: ChatPrompt | str) -> ChatPrompt:
        return ChatPrompt.join((self, other))

    def __radd__(self, other: str) -> ChatPrompt:
        return ChatPrompt.join((other, self))

    @property
    def text(self) -> str:
        """The prompt as one string (markers written out): what a raw-prompt API would be sent."""
        return "".join(s.text for s in self.segments)

    def after(self, offset: int) -> ChatPrompt:
        """The prompt without its first `offset` characters (which must not end inside a marker)."""
        out: list[Segment] = []
        for s in self.segments:
            if offset >= len(s.text):
                offset -= len(s.text)
                continue
            if offset and s.special:
                raise ValueError(f"offset inside the marker {s.text!r}")
            out.append(Segment(s.text[offset:], s.special, s.alone))
            offset = 0
        return ChatPrompt(tuple(out))

    def ids(self, encoder: Encoder, add_bos: bool = True) -> list[int]:
        """The markers' special ids, each piece encoded ordinarily on its own, and the other text between two
        markers or pieces encoded ordinarily as one run."""
        ids = [encoder.bos_id] if add_bos else []
        run: list[str] = []
        marker_ids: dict[str, list[int]] = {}  # an image's pad markers repeat thousands of times
        for s in self.segments:
            if not (s.special or s.alone):
                run.append(s.text)
                continue
            ids.extend(encoder.encode_ordinary("".join(run)))
            run.clear()
            if s.alone:
                ids.extend(encoder.encode_ordinary(s.text))
                continue
            marker = marker_ids.get(s.text)
            if marker is None:
                marker = marker_ids[s.text] = encoder.encode(s.text)
            if len(marker) != 1:
                raise ValueError(f"{s.text!r} is not a single token of this tokenizer")
            ids.extend(marker)
        ids.extend(encoder.encode_ordinary("".join(run)))
        return ids


def _as_prompt(part: ChatPrompt | str) -> ChatPrompt:
    if isinstance(part, ChatPrompt):
        return part
    if isinstance(part, str):
        return ChatPrompt.plain(part)
    raise TypeError(f"a chat prompt joins prompts and strings, not {type(part).__name__}")
