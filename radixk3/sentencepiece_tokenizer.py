"""The built-in sentencepiece BPE tokenizer: exact round trips, special markers, streaming decode, chat template.

The model is trained by `radixk3.tokenizer_train` with identity normalisation, no dummy prefix and byte
fallback, so `decode(encode(s)) == s` for every string: stop strings and few-shot separators depend on it.
Decoding goes through a per-id byte table rather than sentencepiece, so that full and incremental decoding
share one definition and a multi-byte character split over byte-fallback ids is never cut in half.

Generation ends on `stop_ids`: the model's eos (`</s>`), the chat end-of-turn marker `<|im_end|>` and K3's
end of message `<|end_of_msg|>`. The K3 output markup (XTML: `<|open|>`, `<|close|>`, `<|sep|>`; see
`runtime.tokenizer.k3_tools`) is special too, so that the built-in model can produce it and a prompt can carry it.
"""

from __future__ import annotations

import re
from pathlib import Path

import sentencepiece as spm

from radixk3.tokenizer_base import CHAT_MARKERS, END_OF_MSG, IM_END, SEPARATOR, XTML_MARKERS, Tokenizer

MODEL_FILENAME = "tokenizer.model"
BUILTIN_MODEL = Path(__file__).parent / "assets" / MODEL_FILENAME

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
# Order fixes their ids (4..10, then the XTML markers 11..14, appended so the older ids stay); "\n" is a
# symbol so that newlines never merge into other pieces.
USER_SYMBOLS = ("\n", *CHAT_MARKERS, SEPARATOR, *XTML_MARKERS)

# sentencepiece turns a literal U+2581 into a space on decode, so the tokenizer sends it through bytes.
SPACE_MARK = "\u2581"


class SentencePieceTokenizer(Tokenizer):
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
        self.has_xtml = all(sp.piece_to_id(m) != sp.unk_id() for m in XTML_MARKERS)
        xtml = XTML_MARKERS if self.has_xtml else ()
        self._space_bytes = [sp.piece_to_id(f"<0x{b:02X}>") for b in SPACE_MARK.encode()]
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
                table.append(piece.replace(SPACE_MARK, " ").encode())
        special.update(sp.piece_to_id(m) for m in (*CHAT_MARKERS, *xtml))
        self._bytes = tuple(table)
        # Encoding round-trips exactly, so a text of b UTF-8 bytes is at least b / max_token_bytes tokens.
        self.max_token_bytes = max(len(b) for b in table)
        self.special_ids = frozenset(special)
        # The special pieces sentencepiece matches in text (user-defined symbols; it never matches control ones).
        markers = sorted((*CHAT_MARKERS, *xtml), key=len, reverse=True)
        self._special_markers = re.compile("|".join(map(re.escape, markers)))
        self.im_end_id = sp.piece_to_id(IM_END)
        self.separator_id: int = sp.piece_to_id(SEPARATOR)
        self.end_of_msg_id = sp.piece_to_id(END_OF_MSG) if self.has_xtml else None

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

    def id_to_piece(self, token_id: int) -> str:
        self._check_id(token_id)
        return self._sp.id_to_piece(token_id)

    def piece_to_id(self, piece: str) -> int:
        """The id of `piece`, or unk's id when the vocabulary lacks it."""
        return self._sp.piece_to_id(piece)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of a raw prompt: special markers written in the text encode to their single ids."""
        ids = [self.bos_id] if add_bos else []
        parts = text.split(SPACE_MARK)
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

    def _id_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._bytes):
            raise IndexError(f"token id {token_id} outside the vocabulary [0, {len(self._bytes)})")


def load_sentencepiece(file: Path) -> SentencePieceTokenizer:
    if not file.is_file():
        raise FileNotFoundError(f"no sentencepiece tokenizer model at {file}")
    return SentencePieceTokenizer(file.read_bytes())
