"""The texts the tiktoken tokenizer tests run over, and an independent reference: tiktoken's own `Encoding` built
from the written files with Kimi's pattern as the issue lists it, applied with Kimi's cuts as its
`tokenization_kimi.py` writes them (a character loop)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from tests.radixk3.test_tokenizer import TRICKY, gsm8k_test_texts

REFERENCE_PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",  # noqa: E501
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",  # noqa: E501
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

MARKER_TEXTS = [
    "<|im_end|>",
    "stop here <|im_end|> and go on",
    "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>",
    "<|open|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>",
    "[BOS][EOS][PAD][UNK] <|reserved_token_3700|> <|tool_calls_section_begin|>",
    "<<|im_end|>|> <|im_end|<|im_end|>> <|im_en",
]
UNICODE_TEXTS = [
    "\u4e2d\u6587\u6587\u672c\u548c\u65e5\u672c\u8a9e\u6df7\u5728\u4e00\u8d77\uff0c\u8fd8\u6709English words",
    "\ud55c\uad6d\uc5b4 \u0440\u0443\u0441\u0441\u043a\u0438\u0439 "
    "\u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u05e2\u05d1\u05e8\u05d9\u05ea",
    "emoji \U0001f600\U0001f680 family \U0001f468\u200d\U0001f469\u200d\U0001f467 flag \U0001f1fa\U0001f1f8 "
    "skin \U0001f44d\U0001f3fd",
    "combining e\u0301 a\u0308\u0304 n\u0303 Zalgo z\u0336\u0353\u0317a\u0337l\u0315g\u0334o\u0338",
    "digits 1234567890 12 345 6789 \uff11\uff12\uff13 \u0661\u0662\u0663",
    "I'm sure they've said we'LL see it's THEY'RE",
    "tabs\t\tand\r\nwindows\r\n\r\n  newlines \n\n\n end   ",
]
SURROGATE_TEXTS = ["lone \ud800 high", "lone \udfff low", "split pair \ud83d\ude00 joined", "\ud800"]
LONG_TEXTS = [
    " " * 30_001,
    "a" * 60_001,
    "x " + "\n" * 25_000 + "y" + "\t" * 50_003,
    ("\u4e2d" * 25_001) + " end",
    "the" * 20_000,  # the 25,000-character cut falls inside a "the"
    "xy" + "the " * 110_000,  # two 400,000-character pieces, the cut inside a "the"
]


def corpus(with_long: bool = True) -> list[str]:
    texts = [*gsm8k_test_texts()[:600], *TRICKY, *MARKER_TEXTS, *UNICODE_TEXTS]
    return texts + (LONG_TEXTS if with_long else [])


def kimi_split(s: str, max_run: int) -> Iterator[str]:
    """tokenization_kimi.py's `_split_whitespaces_or_nonwhitespaces`, as a character loop."""
    run, space, start = 0, s[0].isspace() if s else False, 0
    for i, c in enumerate(s):
        if space ^ c.isspace():
            run, space = 1, c.isspace()
        else:
            run += 1
            if run > max_run:
                yield s[start:i]
                start, run = i, 1
    yield s[start:]


def kimi_cut(s: str) -> Iterator[str]:
    for i in range(0, len(s), 400_000):
        yield from kimi_split(s[i : i + 400_000], 25_000)


@cache
def reference(directory: Path) -> tiktoken.Encoding:
    ranks = load_tiktoken_bpe(str(directory / "tiktoken.model"))
    named = {int(k): v["content"] for k, v in
             json.loads((directory / "tokenizer_config.json").read_text())["added_tokens_decoder"].items()}
    base = len(ranks)
    special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + 256)}
    return tiktoken.Encoding("reference", pat_str=REFERENCE_PAT_STR, mergeable_ranks=ranks, special_tokens=special)


def reference_encode(enc: tiktoken.Encoding, s: str, special: bool) -> list[int]:
    out: list[int] = []
    for piece in kimi_cut(s):
        out += enc.encode(piece, allowed_special="all") if special else enc.encode(piece, disallowed_special=())
    return out
