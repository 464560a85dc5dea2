"""A transformers tokenizer of the built-in vocabulary, built offline (the `tokenizers` library's BPE with byte
fallback, merges read from the sentencepiece model's scores as transformers' converter reads them), so that
transformers' `apply_chat_template` can be compared with radixk3's on the same files. Its ids equal radixk3's
`Tokenizer.encode` on text without a literal U+2581 (which radixk3 sends through bytes)."""

from __future__ import annotations

from pathlib import Path

import sentencepiece as spm
from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as RustTokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from radixk3.tokenizer import BUILTIN_MODEL, CHAT_MARKERS, USER_SYMBOLS, XTML_MARKERS

_SPACE_MARK = "\u2581"


def _bpe() -> RustTokenizer:
    sp = spm.SentencePieceProcessor(model_file=str(BUILTIN_MODEL))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}

    def mergeable(i: int) -> bool:
        return not (sp.is_control(i) or sp.is_byte(i) or sp.is_unknown(i) or sp.id_to_piece(i) in USER_SYMBOLS)

    merges = [(piece[:k], piece[k:]) for piece, i in vocab.items() if mergeable(i) for k in range(1, len(piece))
              if piece[:k] in vocab and piece[k:] in vocab and mergeable(vocab[piece[:k]])
              and mergeable(vocab[piece[k:]])]
    # A merge's rank is its result's score (sentencepiece BPE merges the best-scoring pair first).
    merges.sort(key=lambda m: (-sp.get_score(vocab[m[0] + m[1]]), vocab[m[0]], vocab[m[1]]))
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                                   fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", _SPACE_MARK)
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()])
    # radixk3's special markers are special here; "\n" and <|separator|> are plain symbols matched anywhere.
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in (*CHAT_MARKERS, *XTML_MARKERS)])
    tok.add_tokens([AddedToken(m, special=False, normalized=False)
                    for m in USER_SYMBOLS if m not in (*CHAT_MARKERS, *XTML_MARKERS)])
    return tok


def save_hf_tokenizer(out_dir: Path) -> Path:
    """Write the transformers tokenizer files (tokenizer.json, tokenizer_config.json) into `out_dir`."""
    hf = PreTrainedTokenizerFast(tokenizer_object=_bpe(), bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                 pad_token="<pad>")
    hf.save_pretrained(out_dir)
    return out_dir


def load_hf_tokenizer(model_dir: Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(model_dir)
