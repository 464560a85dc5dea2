"""Kimi's tiktoken tokenizer, as every Kimi checkpoint (Kimi-Linear, K2, K3) ships it, through the `tiktoken` package.

Files: `tiktoken.model` (one `base64(token bytes) rank` per line: the mergeable ranks, ids 0..n-1) and
`tokenizer_config.json`, whose `added_tokens_decoder` names the special ids and whose `bos_token` / `eos_token` /
`pad_token` / `unk_token` say which is which. As Kimi's `tokenization_kimi.py` builds it: 256 reserved special
ids right after the base vocabulary, the unnamed ones `<|reserved_token_{id}|>` (Kimi's own class reserves two
more past those 256, beyond every Kimi config's `vocab_size`; they are left out here); the pre-tokenizer pattern
`KIMI_PAT_STR`; a text is cut into pieces of at most 400,000 characters and runs of at most 25,000 consecutive
whitespace or non-whitespace characters before tiktoken sees it (`kimi_pieces`), which keeps tiktoken's regex
from panicking or going quadratic on long runs, and cuts where Kimi's cuts.

Lone surrogates (text that is not valid Unicode: a JSON `"\\ud800"`) are encoded as tiktoken encodes them: the
text goes through UTF-16 with replacement, so each lone surrogate becomes U+FFFD and a split pair written as two
escapes joins into its character. Kimi's tokenizer calls tiktoken the same way, so the ids agree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from radixk3.tokenizer_base import END_OF_MSG, IM_END, XTML_MARKERS, Tokenizer

MODEL_FILENAME = "tiktoken.model"
CONFIG_FILENAME = "tokenizer_config.json"
NUM_RESERVED_SPECIAL_TOKENS = 256
# tokenization_kimi.py's pat_str, alternative by alternative: Han runs; two cased-letter runs over letters and
# marks other than Han, with an optional English contraction; up to three digits; punctuation runs with the
# newlines after them; newline runs; whitespace not followed by a non-space; whitespace.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000

# Runs of whitespace or of anything else, as str.isspace() tells them apart (re's \s for str patterns is the same
# test, Py_UNICODE_ISSPACE).
_RUNS = re.compile(r"\s+|\S+")
_LONG_RUN = re.compile(rf"\s{{{MAX_RUN_CHARS + 1},}}|\S{{{MAX_RUN_CHARS + 1},}}")


def kimi_pieces(text: str) -> Iterator[str]:
    """`text` cut as Kimi's tokenizer cuts it before encoding: 400,000-character pieces, each cut again inside
    every run of more than 25,000 whitespace (or non-whitespace) characters, 25,000 characters from the run's
    start, then every 25,000 characters."""
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        piece = text[start : start + MAX_ENCODE_CHARS]
        if _LONG_RUN.search(piece) is None:  # the common case: nothing to cut
            yield piece
            continue
        begin = 0
        for run in _RUNS.finditer(piece):
            for cut in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                yield piece[begin:cut]
                begin = cut
        yield piece[begin:]


def _token_name(value: Any) -> str | None:
    """A `bos_token`-style field: a string, an AddedToken dict `{"content": ...}` or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TiktokenTokenizer(Tokenizer):
    """Kimi's tiktoken BPE: `tiktoken.Encoding(pat_str=KIMI_PAT_STR, mergeable_ranks, special_tokens)`."""

    def __init__(self, ranks: dict[bytes, int], config: dict[str, Any], name: str = MODEL_FILENAME) -> None:
        base = len(ranks)
        if sorted(ranks.values()) != list(range(base)):
            raise ValueError(f"{MODEL_FILENAME}: the ranks are not 0..{base - 1}")
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:  # a byte outside the ranks could never be encoded
            raise ValueError(f"{MODEL_FILENAME}: no token for the bytes {missing[:8]}")
        end = base + NUM_RESERVED_SPECIAL_TOKENS
        named: dict[int, str] = {}
        for key, entry in (config.get("added_tokens_decoder") or {}).items():
            token_id, content = int(key), _token_name(entry)
            if content is None or not base <= token_id < end:
                raise ValueError(f"{CONFIG_FILENAME}: added token {key} {entry!r} is not one of the "
                                 f"{NUM_RESERVED_SPECIAL_TOKENS} special ids [{base}, {end})")
            named[token_id] = content
        special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, end)}
        if len(special) != NUM_RESERVED_SPECIAL_TOKENS:
            raise ValueError(f"{CONFIG_FILENAME}: two special ids share a name")
        self._enc = tiktoken.Encoding(name, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=special)
        self._special_names = special
        self._bytes = [self._enc.decode_single_token_bytes(i) for i in range(base)]
        self._bytes += [name.encode() for name in special]  # dict order is id order
        self.special_ids = frozenset(range(base, end))
        self.max_token_bytes = max(len(b) for b in self._bytes)
        self.has_xtml = all(m in special for m in XTML_MARKERS)
        self.im_end_id = special.get(IM_END)
        self.end_of_msg_id = special.get(END_OF_MSG)

        def role(field: str) -> int | None:
            token = _token_name(config.get(field))
            if token is not None and token not in special:
                raise ValueError(f"{CONFIG_FILENAME}: {field} {token!r} is not a special token")
            return None if token is None else special[token]

        bos, eos = role("bos_token"), role("eos_token")
        if bos is None or eos is None:
            raise ValueError(f"{CONFIG_FILENAME} names no bos_token or no eos_token")
        self._bos, self._eos = bos, eos
        pad = role("pad_token")
        self._pad = eos if pad is None else pad
        self.unk_id = role("unk_token")

    @property
    def vocab_size(self) -> int:
        return len(self._bytes)

    @property
    def base_vocab_size(self) -> int:
        """The mergeable ranks; the special ids follow them."""
        return self.vocab_size - NUM_RESERVED_SPECIAL_TOKENS

    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def pad_id(self) -> int:
        return self._pad

    def special_id(self, name: str) -> int | None:
        """The id of a special token by its name (`"<|im_end|>"`), None for anything else."""
        return self._special_names.get(name)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of a raw prompt: every special token's name written in the text encodes to its id."""
        ids = [self._bos] if add_bos else []
        for piece in kimi_pieces(text):
            ids.extend(self._enc.encode(piece, allowed_special="all"))
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Token ids of `text` as text: special token names are ordinary text (tiktoken's `encode_ordinary`,
        i.e. `disallowed_special=()`)."""
        ids: list[int] = []
        for piece in kimi_pieces(text):
            ids.extend(self._enc.encode_ordinary(piece))
        return ids

    def _id_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]


def load_tiktoken(directory: Path) -> TiktokenTokenizer:
    """The tokenizer of a directory holding `tiktoken.model` and `tokenizer_config.json`."""
    config_file = directory / CONFIG_FILENAME
    if not config_file.is_file():
        raise FileNotFoundError(f"{directory} holds a {MODEL_FILENAME} but no {CONFIG_FILENAME} naming its "
                                "special tokens")
    config = json.loads(config_file.read_text())
    return TiktokenTokenizer(load_tiktoken_bpe(str(directory / MODEL_FILENAME)), config)
