"""Writes a tokenizer in the files Kimi's checkpoints ship (`tiktoken.model` + `tokenizer_config.json`), for tests
and `radixk3 make-checkpoint --tokenizer tiktoken`.

The ranks are a real BPE for gsm8k text, derived from the built-in sentencepiece model: the 256 single bytes
first (every byte, `\\n` included, is encodable), then the model's pieces in score order (U+2581 read as a space),
each kept when its bytes join two tokens already present, so that tiktoken's merge by rank can build it; a
multi-byte character that no two tokens join gets its byte prefixes first. The base vocabulary is cut so that
base + 256 special ids is `TINY_TIKTOKEN_VOCAB_SIZE`, what a checkpoint using it must give as `vocab_size`.

The special ids follow Kimi's `added_tokens_decoder` layouts: K3's ([BOS] +0, [EOS] +1, `<|end_of_msg|>` +2,
`<|open|>` +3, `<|close|>` +4, `<|sep|>` +5, the image markers `<|media_begin|>` ... `<|media_pad|>` +18..+21,
[UNK] +254, [PAD] +255) where K2 / Kimi-Linear put their turn markers (`<|im_end|>`, `<|im_user|>`,
`<|im_assistant|>` at +2..+4), which therefore move to slots neither names (+22..+24); K2's other ids are kept
(`<|im_system|>` +10, the tool-call markers +11..+15, `<|im_middle|>` +17).
"""

from __future__ import annotations

import base64
import json
from functools import cache
from pathlib import Path

import sentencepiece as spm

from radixk3.sentencepiece_tokenizer import BUILTIN_MODEL, SPACE_MARK, USER_SYMBOLS
from radixk3.tiktoken_tokenizer import CONFIG_FILENAME, MODEL_FILENAME, NUM_RESERVED_SPECIAL_TOKENS
from radixk3.tokenizer_base import (
    END_OF_MSG,
    IM_ASSISTANT,
    IM_END,
    IM_MIDDLE,
    IM_SYSTEM,
    IM_USER,
    XTML_CLOSE,
    XTML_OPEN,
    XTML_SEP,
)

TINY_TIKTOKEN_VOCAB_SIZE = 3840  # base ranks + NUM_RESERVED_SPECIAL_TOKENS: a checkpoint's config vocab_size
TINY_TIKTOKEN_BASE = TINY_TIKTOKEN_VOCAB_SIZE - NUM_RESERVED_SPECIAL_TOKENS  # the first special id ([BOS])
BOS, EOS, UNK, PAD = "[BOS]", "[EOS]", "[UNK]", "[PAD]"
TOOL_CALL_MARKERS = (
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
# Offsets from the base vocabulary (see the module's docstring); a config's bos / eos / pad ids are
# TINY_TIKTOKEN_BASE + the offsets of BOS, EOS and PAD.
SPECIAL_OFFSETS: dict[int, str] = {
    0: BOS, 1: EOS, 2: END_OF_MSG, 3: XTML_OPEN, 4: XTML_CLOSE, 5: XTML_SEP,
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: IM_SYSTEM,
    **{11 + k: m for k, m in enumerate(TOOL_CALL_MARKERS)},
    17: IM_MIDDLE, 18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
    22: IM_END, 23: IM_USER, 24: IM_ASSISTANT,
    254: UNK, 255: PAD,
}


@cache
def tiny_ranks() -> dict[bytes, int]:
    """Mergeable ranks derived from the built-in sentencepiece model (see the module's docstring)."""
    sp = spm.SentencePieceProcessor(model_file=str(BUILTIN_MODEL))
    ranks = {bytes([b]): b for b in range(256)}

    def add(token: bytes) -> None:
        if token not in ranks:
            ranks[token] = len(ranks)

    pieces = [i for i in range(sp.get_piece_size())
              if not (sp.is_byte(i) or sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)
                      or sp.id_to_piece(i) in USER_SYMBOLS)]
    for i in sorted(pieces, key=lambda i: (-sp.get_score(i), i)):
        token = sp.id_to_piece(i).replace(SPACE_MARK, " ").encode()
        if token in ranks:
            continue
        if not any(token[:k] in ranks and token[k:] in ranks for k in range(1, len(token))):
            for k in range(2, len(token)):  # a character no two tokens join: its byte prefixes first
                add(token[:k])
        add(token)
    if len(ranks) < TINY_TIKTOKEN_BASE:
        raise ValueError(f"the built-in model gives {len(ranks)} ranks, fewer than {TINY_TIKTOKEN_BASE}")
    return {t: r for t, r in ranks.items() if r < TINY_TIKTOKEN_BASE}


def added_tokens_decoder(base: int) -> dict[str, dict[str, object]]:
    """`tokenizer_config.json`'s special tokens, as transformers writes them."""
    return {
        str(base + offset): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": True}
        for offset, name in sorted(SPECIAL_OFFSETS.items())
    }


def write_tiktoken_tokenizer(out_dir: str | Path, ranks: dict[bytes, int] | None = None) -> Path:
    """Write `tiktoken.model` and `tokenizer_config.json` into `out_dir` (made if missing); returns the directory.
    `ranks` defaults to `tiny_ranks()`. The config names Kimi's tokenizer class as the published ones do
    (`auto_map`): transformers would need the checkpoint's `tokenization_kimi.py`, which is not written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ranks = tiny_ranks() if ranks is None else ranks
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in sorted(ranks.items(), key=lambda x: x[1])]
    (out / MODEL_FILENAME).write_text("\n".join(lines) + "\n")
    config = {
        "added_tokens_decoder": added_tokens_decoder(len(ranks)),
        "additional_special_tokens": [IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE, END_OF_MSG],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (out / CONFIG_FILENAME).write_text(json.dumps(config, indent=2) + "\n")
    return out
