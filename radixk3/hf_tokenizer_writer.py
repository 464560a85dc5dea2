"""Writes a sentencepiece model as transformers' tokenizer files (`tokenizer.json` + `tokenizer_config.json`), so that
clients that tokenize locally (SGLang's bench_serving, lm-eval, `AutoTokenizer`) get radixk3's ids.

    python -m radixk3.hf_tokenizer_writer        # rewrite the built-in model's files in radixk3/assets/

The `tokenizers` library's BPE with byte fallback, its merges read from the sentencepiece model's scores as
transformers' converter reads them (a merge's rank is its result's score). One departure from that converter keeps
the ids equal for every string: the pieces are written with a plain space where sentencepiece writes U+2581, and
there is no normalizer. Sentencepiece cannot tell a literal U+2581 in the text from a space, so radixk3 sends it
through its three byte ids; with spaces in the pieces a literal U+2581 matches no piece here either and falls back
to the same bytes. The model was trained with whitespace splitting (a piece holds U+2581 only first), so no merge
crosses a word boundary and no pre-tokenizer is needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import sentencepiece as spm
from tokenizers import AddedToken, decoders, models
from tokenizers import Tokenizer as RustTokenizer

from radixk3.sentencepiece_tokenizer import BUILTIN_MODEL, SPACE_MARK, USER_SYMBOLS
from radixk3.tokenizer_base import CHAT_MARKERS, XTML_MARKERS

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


def hf_tokenizer(model_file: Path = BUILTIN_MODEL) -> RustTokenizer:
    """The `tokenizers` tokenizer of the sentencepiece model in `model_file`."""
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]

    def text(i: int) -> str:
        # Control, unknown and byte pieces keep their names (byte fallback looks up "<0xNN>").
        plain = not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))
        return pieces[i].replace(SPACE_MARK, " ") if plain else pieces[i]

    vocab = {text(i): i for i in range(len(pieces))}
    specials = {*CHAT_MARKERS, *XTML_MARKERS}

    def mergeable(i: int) -> bool:
        return not (sp.is_control(i) or sp.is_byte(i) or sp.is_unknown(i) or pieces[i] in USER_SYMBOLS)

    merges = [(piece[:k], piece[k:]) for piece, i in vocab.items() if mergeable(i) for k in range(1, len(piece))
              if piece[:k] in vocab and piece[k:] in vocab and mergeable(vocab[piece[:k]])
              and mergeable(vocab[piece[k:]])]
    # Sentencepiece BPE merges the best-scoring pair first; ties by the parts' ids, as transformers' converter.
    merges.sort(key=lambda m: (-sp.get_score(vocab[m[0] + m[1]]), vocab[m[0]], vocab[m[1]]))
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=pieces[sp.unk_id()], byte_fallback=True,
                                   fuse_unk=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    # radixk3's special markers are special here; "\n" and <|separator|> are plain symbols matched anywhere.
    present = [m for m in USER_SYMBOLS if sp.piece_to_id(m) != sp.unk_id()]
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in present if m in specials])
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in present if m not in specials])
    return tok


def tokenizer_config(model_file: Path = BUILTIN_MODEL) -> dict[str, object]:
    """`tokenizer_config.json`: the class that reads `tokenizer.json`, and the model's control pieces."""
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": sp.id_to_piece(sp.bos_id()),
        "eos_token": sp.id_to_piece(sp.eos_id()),
        "unk_token": sp.id_to_piece(sp.unk_id()),
        "pad_token": sp.id_to_piece(sp.pad_id()),
        # Decoding is exact (sentencepiece's round trip); transformers' cleanup would drop spaces before ".".
        "clean_up_tokenization_spaces": False,
    }


def write_hf_tokenizer(out_dir: Path, model_file: Path = BUILTIN_MODEL) -> Path:
    """Write `tokenizer.json` and `tokenizer_config.json` for `model_file` into `out_dir`; returns `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_tokenizer(model_file).save(str(out_dir / TOKENIZER_FILE), pretty=True)
    (out_dir / CONFIG_FILE).write_text(json.dumps(tokenizer_config(model_file), indent=2) + "\n")
    return out_dir


if __name__ == "__main__":
    print(write_hf_tokenizer(BUILTIN_MODEL.parent))
