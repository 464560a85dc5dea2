"""Which tokenizer a model directory gets (`load_tokenizer`), and the names the rest of radixk3 imports.

`--tokenizer-mode` (as vLLM and SGLang spell it): `native` is radixk3's own, in the tokenizer process, for the files
it knows: a sentencepiece `tokenizer.model` (the built-in kind) or Kimi's `tiktoken.model` with its
`tokenizer_config.json`; `hf` is the checkpoint's own class through transformers' `AutoTokenizer` (remote code only
with `--trust-remote-code`); `auto` is native when it recognises the files, else hf.
"""

from __future__ import annotations

import json
from pathlib import Path

from radixk3.sentencepiece_tokenizer import (
    BOS_ID,
    BUILTIN_MODEL,
    EOS_ID,
    MODEL_FILENAME,
    PAD_ID,
    UNK_ID,
    USER_SYMBOLS,
    SentencePieceTokenizer,
    load_sentencepiece,
)
from radixk3.tiktoken_tokenizer import MODEL_FILENAME as TIKTOKEN_FILENAME
from radixk3.tiktoken_tokenizer import load_tiktoken
from radixk3.tokenizer_base import (
    CHAT_MARKERS,
    END_OF_MSG,
    IM_ASSISTANT,
    IM_END,
    IM_MIDDLE,
    IM_SYSTEM,
    IM_USER,
    SEPARATOR,
    TOKENIZER_MODES,
    XTML_CLOSE,
    XTML_MARKERS,
    XTML_OPEN,
    XTML_SEP,
    Encoder,
    IncrementalDecoder,
    Tokenizer,
    chat_turn,
    turn_start,
)

__all__ = [
    "BOS_ID", "BUILTIN_MODEL", "CHAT_MARKERS", "END_OF_MSG", "EOS_ID", "Encoder", "IM_ASSISTANT", "IM_END",
    "IM_MIDDLE", "IM_SYSTEM", "IM_USER", "IncrementalDecoder", "MODEL_FILENAME", "PAD_ID", "RemoteCodeRequired",
    "SEPARATOR", "SentencePieceTokenizer", "TOKENIZER_MODES", "Tokenizer", "UNK_ID", "USER_SYMBOLS", "XTML_CLOSE",
    "XTML_MARKERS", "XTML_OPEN", "XTML_SEP", "chat_turn", "checkpoint_tokenizer", "has_tokenizer_files",
    "load_tokenizer", "tokenizer_kind", "turn_start",
]

NATIVE_FILES = (MODEL_FILENAME, TIKTOKEN_FILENAME)
# What transformers' AutoTokenizer reads a tokenizer from.
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


class RemoteCodeRequired(ValueError):
    """The checkpoint's tokenizer is its own Python class, which runs only with --trust-remote-code."""


def has_tokenizer_files(directory: Path) -> bool:
    return any((directory / f).is_file() for f in (*NATIVE_FILES, *HF_FILES))


def _names_remote_code(directory: Path) -> bool:
    config = directory / "tokenizer_config.json"
    return config.is_file() and "auto_map" in json.loads(config.read_text())


def tokenizer_kind(directory: str | Path, mode: str = "auto", trust_remote_code: bool = False) -> str:
    """Which tokenizer `load_tokenizer` gives a directory: "sentencepiece", "tiktoken" or "hf" (by `mode`, see the
    module's docstring), checked without loading it: FileNotFoundError for native mode without native files,
    RemoteCodeRequired for the checkpoint's own class without `trust_remote_code`."""
    if mode not in TOKENIZER_MODES:
        raise ValueError(f"--tokenizer-mode must be one of {', '.join(TOKENIZER_MODES)}, got {mode!r}")
    where = Path(directory)
    if mode != "hf":
        if (where / MODEL_FILENAME).is_file():
            return "sentencepiece"
        if (where / TIKTOKEN_FILENAME).is_file():
            return "tiktoken"
        if mode == "native":
            raise FileNotFoundError(f"{where} holds no tokenizer radixk3 reads natively ({' or '.join(NATIVE_FILES)});"
                                    " --tokenizer-mode hf loads it through transformers")
    if _names_remote_code(where) and not trust_remote_code:
        raise RemoteCodeRequired(f"{where}'s tokenizer_config.json names its own tokenizer class (auto_map): "
                                 "loading it runs the checkpoint's code, which needs --trust-remote-code")
    return "hf"


def load_tokenizer(path: str | Path | None = None, mode: str = "auto", trust_remote_code: bool = False) -> Tokenizer:
    """The built-in tokenizer when `path` is None; else the tokenizer of a directory (`tokenizer_kind`), or of a
    sentencepiece `tokenizer.model` file or a `tiktoken.model` file (with its `tokenizer_config.json` beside it)."""
    if path is None:
        return load_sentencepiece(BUILTIN_MODEL)
    where = Path(path)
    if not where.is_dir():
        if where.name == TIKTOKEN_FILENAME:  # its special tokens are named beside it
            return load_tiktoken(where.parent)
        return load_sentencepiece(where)
    kind = tokenizer_kind(where, mode, trust_remote_code)
    if kind == "sentencepiece":
        return load_sentencepiece(where / MODEL_FILENAME)
    if kind == "tiktoken":
        return load_tiktoken(where)
    try:
        from radixk3.hf_tokenizer import HfTokenizer  # transformers loads only for this mode
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"--tokenizer-mode hf needs transformers (pip install radixk3[hf]): {e}") from e
    return HfTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code)


def checkpoint_tokenizer(directory: str | Path | None, mode: str = "auto",
                         trust_remote_code: bool = False) -> Tokenizer:
    """A model directory's tokenizer; the built-in one for the built-in model (None) and for a directory without
    tokenizer files (a checkpoint radixk3 wrote for its built-in tokenizer), unless `mode` is hf."""
    if directory is None or (mode != "hf" and not has_tokenizer_files(Path(directory))):
        return load_tokenizer()
    return load_tokenizer(directory, mode, trust_remote_code)
