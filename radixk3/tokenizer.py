"""The built-in sentencepiece BPE tokenizer: exact round trips, special markers, streaming decode, chat template.

The model is trained by `radixk3.tokenizer_train` with identity normalisation, no dummy prefix and byte
fallback, so `decode(encode(s)) == s` for every string: stop strings and few-shot separators depend on it.
Decoding goes through a per-id byte table rather than sentencepiece, so that full and incremental decoding
share one definition and a multi-byte character split over byte-fallback ids is never cut in half.

Generation ends on `stop_ids`: the model's eos (`</s>`), the chat end-of-turn marker `<|im_end|>` and K3's
end of message `<|end_of_msg|>`. The K3 output markup (XTML: `<|open|>`, `<|close|>`, `<|sep|>`; see
`runtime.tokenizer.k3_tools`) is special too, so that the built-in model can produce it and a prompt can carry it.

Two ways to encode, as tiktoken has them (`Encoder`): `encode` reads marker strings as their special ids (a raw
prompt whose caller wrote the template), `encode_ordinary` never gives a special id (text from users and tools;
chat renderers build a `radixk3.chat_prompt.ChatPrompt` whose markers alone become special ids).
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import sentencepiece as spm

from radixk3.chat_prompt import ChatPrompt

MODEL_FILENAME = "tokenizer.model"
BUILTIN_MODEL = Path(__file__).parent / "assets" / MODEL_FILENAME

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
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
# Order fixes their ids (4..10, then the XTML markers 11..14, appended so the older ids stay); "\n" is a
# symbol so that newlines never merge into other pieces.
USER_SYMBOLS = ("\n", *CHAT_MARKERS, SEPARATOR, *XTML_MARKERS)

_ROLE_MARKERS = {"system": IM_SYSTEM, "user": IM_USER, "assistant": IM_ASSISTANT}
# sentencepiece turns a literal U+2581 into a space on decode, so the tokenizer sends it through bytes.
_SPACE_MARK = "\u2581"


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
    """What every tokenizer offers to encode, after tiktoken's `encode` / `encode_ordinary`. For every string
    `s`, `decode(encode_ordinary(s)) == s` and `encode_ordinary(s)` holds no special id."""

    @property
    def bos_id(self) -> int: ...

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """A raw prompt, templated by its caller: marker strings in it become their special ids."""
        ...

    def encode_ordinary(self, text: str) -> list[int]:
        """Text as text: a marker string in it is encoded as ordinary pieces, never as a special id."""
        ...


class Tokenizer:
    """A sentencepiece model with exact round trips; ids are plain ints below `vocab_size`.

    Special ids are the control pieces (pad, unk, bos, eos) and the chat markers; `decode` drops them when
    `skip_special_tokens`. `<|separator|>` is a text delimiter, not special: stop strings must see it.
    """

    def __init__(self, model_proto: bytes) -> None:
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        sp = self._sp
        n = sp.get_piece_size()
        missing = [m for m in (*CHAT_MARKERS, SEPARATOR) if sp.piece_to_id(m) == sp.unk_id()]
        if missing:
            raise ValueError(f"tokenizer model lacks the chat markers {missing}")
        # K3's markup tokens (tools, reasoning): optional, so that tokenizers trained before them still load.
        self.has_xtml: bool = all(sp.piece_to_id(m) != sp.unk_id() for m in XTML_MARKERS)
        xtml = XTML_MARKERS if self.has_xtml else ()
        self._space_bytes = [sp.piece_to_id(f"<0x{b:02X}>") for b in _SPACE_MARK.encode()]
        if sp.unk_id() in self._space_bytes:
            raise ValueError("tokenizer model was trained without byte fallback")
        table: list[bytes] = []
        special: set[int] = set()
        for i in range(n):
            piece = sp.id_to_piece(i)
            if sp.is_byte(i):
                table.append(bytes([int(piece[3:5], 16)]))
            elif sp.is_control(i) or sp.is_unknown(i):
                table.append(piece.encode())
                special.add(i)
            else:
                table.append(piece.replace(_SPACE_MARK, " ").encode())
        special.update(sp.piece_to_id(m) for m in (*CHAT_MARKERS, *xtml))
        self._bytes = tuple(table)
        # Encoding round-trips exactly, so a text of b UTF-8 bytes is at least b / max_token_bytes tokens.
        self.max_token_bytes: int = max(len(b) for b in table)
        self.special_ids: frozenset[int] = frozenset(special)
        # The special pieces sentencepiece matches in text (user-defined symbols; it never matches control ones).
        markers = sorted((*CHAT_MARKERS, *xtml), key=len, reverse=True)
        self._special_markers = re.compile("|".join(map(re.escape, markers)))
        self.im_end_id: int = sp.piece_to_id(IM_END)
        self.separator_id: int = sp.piece_to_id(SEPARATOR)
        self.end_of_msg_id: int | None = sp.piece_to_id(END_OF_MSG) if self.has_xtml else None

    @property
    def vocab_size(self) -> int:
        return len(self._bytes)

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end generation: eos, the end-of-turn marker and K3's end of message."""
        ids = (self.eos_id, self.im_end_id, self.end_of_msg_id)
        return tuple(i for i in ids if i is not None)

    def id_to_piece(self, token_id: int) -> str:
        self._check_id(token_id)
        return self._sp.id_to_piece(token_id)

    def piece_to_id(self, piece: str) -> int:
        """The id of `piece`, or unk's id when the vocabulary lacks it."""
        return self._sp.piece_to_id(piece)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of a raw prompt: special markers written in the text encode to their single ids."""
        ids = [self.bos_id] if add_bos else []
        parts = text.split(_SPACE_MARK)
        for k, part in enumerate(parts):
            if k:
                ids.extend(self._space_bytes)
            if part:
                ids.extend(self._sp.encode(part))
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Token ids of `text` as text, never a special id: the text is cut just after the first character of
        each special marker written in it, so no piece encoded holds a whole marker (sentencepiece matches its
        markers wherever they occur). Text without marker strings encodes as `encode` does."""
        ids: list[int] = []
        start = 0
        # Each cut search starts at the last cut, so a piece holds no marker that starts inside it (markers are
        # longer than one character, so one starting at the next cut ends past it).
        while (m := self._special_markers.search(text, start)) is not None:
            ids.extend(self.encode(text[start : m.start() + 1]))
            start = m.start() + 1
        ids.extend(self.encode(text[start:]))
        return ids

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        """The bytes one id contributes to decoded text (a byte-fallback id gives one raw byte)."""
        self._check_id(token_id)
        if skip_special_tokens and token_id in self.special_ids:
            return b""
        return self._bytes[token_id]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 from stray byte ids becomes U+FFFD, as in the incremental decoder."""
        return b"".join(self.token_bytes(i, skip_special_tokens) for i in ids).decode("utf-8", "replace")

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)

    def chat_prompt(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> ChatPrompt:
        """Kimi-style prompt: `<|im_user|>user<|im_middle|>...<|im_end|>` per message, roles
        system/user/assistant; an optional "name" replaces the role word, as in Kimi's template. Contents and
        names are text: `ChatPrompt.ids` never reads a marker in them."""
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

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._bytes):
            raise IndexError(f"token id {token_id} outside the vocabulary [0, {len(self._bytes)})")


class IncrementalDecoder:
    """Streaming detokenizer: `push` returns only newly completed text, holding back the bytes of a
    character whose remaining byte-fallback ids have not arrived; `flush` ends the stream.
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


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The built-in gsm8k tokenizer when `path` is None, else a `tokenizer.model` file or a directory holding one."""
    file = BUILTIN_MODEL if path is None else Path(path)
    if file.is_dir():
        if not (file / MODEL_FILENAME).is_file() and (file / "tiktoken.model").is_file():
            raise FileNotFoundError(f"{file} holds a tiktoken.model; only sentencepiece {MODEL_FILENAME} is supported")
        file = file / MODEL_FILENAME
    if not file.is_file():
        raise FileNotFoundError(f"no sentencepiece tokenizer model at {file}")
    return Tokenizer(file.read_bytes())
