"""The one tokenizer interface the runtime sees, whatever the files behind it: the sentencepiece model radixk3
trains (`radixk3.sentencepiece_tokenizer`), a tiktoken BPE as Kimi's checkpoints ship it
(`radixk3.tiktoken_tokenizer`) or a checkpoint's own transformers tokenizer (`radixk3.hf_tokenizer`).

Every implementation describes each id by the bytes it adds to decoded text (`token_bytes`), so that full and
incremental decoding share one definition and a character split across tokens never reaches a stream as U+FFFD
(`IncrementalDecoder` holds its first bytes back). Special ids are the control tokens; `decode` drops them when
`skip_special_tokens`, and so does the grammar vocabulary, which takes an empty token as "special".

Two ways to encode, as tiktoken has them: `encode` reads marker strings as their special ids (a raw prompt whose
caller wrote the template), `encode_ordinary` never gives a special id (text from users and tools; chat renderers
build a `radixk3.chat_prompt.ChatPrompt` whose markers alone become special ids).
"""

from __future__ import annotations

import codecs
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from radixk3.chat_prompt import ChatPrompt

IM_SYSTEM = "<|im_system|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_MIDDLE = "<|im_middle|>"
IM_END = "<|im_end|>"
SEPARATOR = "<|separator|>"
CHAT_MARKERS = (IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END)
XTML_OPEN = "<|open|>"
XTML_CLOSE = "<|close|>"
XTML_SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
XTML_MARKERS = (XTML_OPEN, XTML_CLOSE, XTML_SEP, END_OF_MSG)

# --tokenizer-mode (see radixk3.tokenizer); here, so that ServerArgs reads it without loading a tokenizer library.
TOKENIZER_MODES = ("auto", "native", "hf")

_ROLE_MARKERS = {"system": IM_SYSTEM, "user": IM_USER, "assistant": IM_ASSISTANT}


def turn_start(role: str, name: str | None = None) -> ChatPrompt:
    """The opening of a chat turn in Kimi's framing, `<|im_user|>user<|im_middle|>`: the role's marker, the
    turn's name (the role word unless `name` replaces it, as in Kimi's template; text), the middle marker. The
    one definition of the framing: the chat template, K3's renderer and the frontend's roles all write it."""
    marker = _ROLE_MARKERS.get(role)
    if marker is None:
        raise ValueError(f"unsupported chat role {role!r}; expected one of {sorted(_ROLE_MARKERS)}")
    return ChatPrompt.marker(marker) + (name or role) + ChatPrompt.marker(IM_MIDDLE)


def chat_turn(role: str, body: ChatPrompt | str, name: str | None = None) -> ChatPrompt:
    """A whole turn: `turn_start`, the body (a string is text), `<|im_end|>`."""
    return turn_start(role, name) + body + ChatPrompt.marker(IM_END)


class Encoder(Protocol):
    """What `ChatPrompt.ids` needs: `encode` reads a marker as its special id, `encode_ordinary` never does."""

    @property
    def bos_id(self) -> int: ...

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def encode_ordinary(self, text: str) -> list[int]: ...


class Tokenizer(ABC):
    """What the runtime needs of a tokenizer. Ids are plain ints below `vocab_size`; for every string `s`
    without lone surrogates, `decode(encode_ordinary(s)) == s` and `encode_ordinary(s)` holds no special id."""

    special_ids: frozenset[int]
    # The most UTF-8 bytes one token stands for (marker names included: `encode` reads them), so that a text of
    # b bytes is at least b / max_token_bytes tokens.
    max_token_bytes: int
    has_xtml: bool  # K3's markup tokens (tools, reasoning) are single special tokens
    im_end_id: int | None  # Kimi's end of turn, where the vocabulary names it
    end_of_msg_id: int | None  # K3's end of message, where the vocabulary names it
    # A transformers tokenizer behind this one (`--tokenizer-mode hf`), whose own `apply_chat_template` renders
    # the checkpoint's chats; None for the native tokenizers.
    hf: Any = None

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def bos_id(self) -> int: ...

    @property
    @abstractmethod
    def eos_id(self) -> int: ...

    @property
    @abstractmethod
    def pad_id(self) -> int: ...

    @abstractmethod
    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of a raw prompt, templated by its caller: marker strings in it become their special ids."""

    @abstractmethod
    def encode_ordinary(self, text: str) -> list[int]:
        """Text as text: a marker string in it is encoded as ordinary pieces, never as a special id."""

    @abstractmethod
    def _id_bytes(self, token_id: int) -> bytes:
        """The bytes of an ordinary id; a special id's name, UTF-8."""

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end generation: eos, the end-of-turn marker and K3's end of message (those named)."""
        ids = (self.eos_id, self.im_end_id, self.end_of_msg_id)
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        """The bytes one id contributes to decoded text (part of a character for a byte-level id)."""
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} outside the vocabulary [0, {self.vocab_size})")
        if skip_special_tokens and token_id in self.special_ids:
            return b""
        return self._id_bytes(token_id)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 (ids cut mid-character) becomes U+FFFD, as in the incremental decoder."""
        return b"".join(self.token_bytes(i, skip_special_tokens) for i in ids).decode("utf-8", "replace")

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)

    def chat_prompt(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> ChatPrompt:
        """Kimi-style prompt: `<|im_user|>user<|im_middle|>...<|im_end|>` per message, roles
        system/user/assistant; an optional "name" replaces the role word, as in Kimi's template. Contents and
        names are text: `ChatPrompt.ids` never reads a marker in them (and refuses a vocabulary without the
        framing markers, as K3's has)."""
        out: list[ChatPrompt] = []
        for m in messages:
            content = m.get("content")
            if not isinstance(content, str):
                raise ValueError(f"chat message content must be a string, got {type(content).__name__}")
            out.append(chat_turn(m.get("role", ""), content, m.get("name")))
        if add_generation_prompt:
            out.append(turn_start("assistant"))
        return ChatPrompt.join(out)

    def apply_chat_template(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """`chat_prompt` as one string, markers written out (as a raw prompt: `encode` reads them)."""
        return self.chat_prompt(messages, add_generation_prompt).text


class IncrementalDecoder:
    """Streaming detokenizer: `push` returns only newly completed text, holding back the bytes of a
    character whose remaining ids have not arrived; `flush` ends the stream.
    The concatenation of every `push` and the final `flush` equals `Tokenizer.decode` of all the ids."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.num_tokens = 0

    def push(self, ids: int | Iterable[int]) -> str:
        ids = (ids,) if isinstance(ids, int) else ids
        data = bytearray()
        for i in ids:
            data += self._tok.token_bytes(i, self._skip)
            self.num_tokens += 1
        return self._utf8.decode(bytes(data))

    def flush(self) -> str:
        """Text of any held-back bytes (U+FFFD for an unfinished character); the decoder then starts afresh."""
        return self._utf8.decode(b"", final=True)

    @property
    def pending(self) -> bytes:
        """Bytes held back: the start of a multi-byte character."""
        return self._utf8.getstate()[0]

    def check_integrity(self) -> None:
        held = self.pending
        assert len(held) <= 3, f"{len(held)} bytes held back; a UTF-8 character has at most 4"
        assert codecs.getincrementaldecoder("utf-8")("strict").decode(held) == "", "held bytes are decodable"
