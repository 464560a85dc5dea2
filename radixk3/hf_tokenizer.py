"""A checkpoint's own transformers tokenizer (`--tokenizer-mode hf`) behind radixk3's `Tokenizer` interface.

Token bytes. Decoding one id alone (`decode([i])`) is not byte-exact: a byte-level token holding part of a UTF-8
character decodes to U+FFFD, and decoders strip or add spaces. So each id's bytes come from its token string
(`convert_ids_to_tokens`), read by the tokenizer's own byte scheme:
- byte-level BPE (a `ByteLevel` decoder, or a slow class with a `byte_decoder` such as Kimi's
  `TikTokenTokenizer`): the string's characters map back to bytes through GPT-2's byte alphabet;
- sentencepiece-style (a `ByteFallback` / `Metaspace` decoder): `<0xNN>` is the byte NN, U+2581 a space
  (a leading space that the decoder would strip stays; the stream is the tokens' bytes);
- otherwise, and for added tokens, the token's text (UTF-8) — byte-exact only for whole-character tokens.
Special ids (`all_special_ids` and added tokens marked special) decode to their names, or to nothing when
`skip_special_tokens`.

`encode` lets the tokenizer match its added tokens in the text (`add_special_tokens=False`: the chat renderer
places bos). `encode_ordinary` asks a fast tokenizer to encode special tokens as text (`split_special_tokens`);
where the result still holds a special id (a slow class that ignores the flag), the text is cut just after the
first character of each special token's name, so no piece encoded holds a whole name. The tokenizer's own
length rules are used as they are (no Kimi 25,000-character cuts: those are the native tiktoken path's).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from radixk3.tokenizer_base import END_OF_MSG, IM_END, XTML_MARKERS, Tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_types(hf: PreTrainedTokenizerBase) -> set[str]:
    """The types of a fast tokenizer's decoder (a Sequence's members included); empty for a slow one."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    members = decoder.get("decoders") or [decoder]
    return {d.get("type", "") for d in members if isinstance(d, dict)}


def _byte_scheme(hf: PreTrainedTokenizerBase) -> str:
    types = _decoder_types(hf)
    if "ByteLevel" in types or hasattr(hf, "byte_decoder"):
        return "byte_level"
    if types & {"ByteFallback", "Metaspace"} or hasattr(hf, "sp_model"):
        return "sentencepiece"
    return "text"


class HfTokenizer(Tokenizer):
    def __init__(self, hf: PreTrainedTokenizerBase) -> None:
        self.hf = hf
        added: dict[int, Any] = dict(hf.added_tokens_decoder)
        self.special_ids = frozenset({*hf.all_special_ids, *(i for i, t in added.items() if t.special)})
        size = max(len(hf), max(added, default=-1) + 1)
        scheme = _byte_scheme(hf)
        unicode_to_byte = {c: b for b, c in bytes_to_unicode().items()}
        table: list[bytes] = []
        for i, token in enumerate(hf.convert_ids_to_tokens(list(range(size)))):
            if i in added:
                table.append(added[i].content.encode())
            elif token is None:
                table.append(b"")
            elif scheme == "byte_level" and all(c in unicode_to_byte for c in token):
                table.append(bytes(unicode_to_byte[c] for c in token))
            elif scheme == "sentencepiece" and (m := _BYTE_PIECE.fullmatch(token)):
                table.append(bytes([int(m.group(1), 16)]))
            elif scheme == "sentencepiece":
                table.append(token.replace("\u2581", " ").encode())
            else:
                table.append(token.encode())
        self._bytes = table
        self.max_token_bytes = max(len(b) for b in table)
        names = {t.content: i for i, t in added.items()}
        names.update(zip(hf.all_special_tokens, hf.all_special_ids, strict=True))
        self._special_names = {n: i for n, i in names.items() if i in self.special_ids}
        self.has_xtml = all(m in self._special_names for m in XTML_MARKERS)
        self.im_end_id = self._special_names.get(IM_END)
        self.end_of_msg_id = self._special_names.get(END_OF_MSG)
        longest_first = sorted(self._special_names, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(map(re.escape, longest_first))) if longest_first else None
        if hf.eos_token_id is None:
            raise ValueError("the tokenizer names no eos token")

    @staticmethod
    def from_pretrained(directory: str | Path, trust_remote_code: bool = False) -> HfTokenizer:
        hf = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code, local_files_only=True)
        return HfTokenizer(hf)

    @property
    def vocab_size(self) -> int:
        return len(self._bytes)

    @property
    def bos_id(self) -> int:
        bos = self.hf.bos_token_id
        return self.eos_id if bos is None else bos  # a tokenizer without bos begins with eos, as GPT-2's does

    @property
    def eos_id(self) -> int:
        return self.hf.eos_token_id

    @property
    def pad_id(self) -> int:
        pad = self.hf.pad_token_id
        return self.eos_id if pad is None else pad

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        return ids + self.hf.encode(text, add_special_tokens=False)

    def encode_ordinary(self, text: str) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False, split_special_tokens=True)
        if self._special_pattern is None or not self.special_ids.intersection(ids):
            return ids
        ids, start = [], 0
        while (m := self._special_pattern.search(text, start)) is not None:
            ids.extend(self.hf.encode(text[start : m.start() + 1], add_special_tokens=False))
            start = m.start() + 1
        ids.extend(self.hf.encode(text[start:], add_special_tokens=False))
        return ids

    def _id_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]
