"""The built-in model's transformers tokenizer files (radixk3/assets/tokenizer.json, tokenizer_config.json): they are
what `radixk3.hf_tokenizer_writer` writes, and `AutoTokenizer` reading them gives radixk3's ids and decodes back."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from radixk3.hf_tokenizer_writer import CONFIG_FILE, TOKENIZER_FILE, write_hf_tokenizer
from radixk3.sentencepiece_tokenizer import SPACE_MARK
from radixk3.tokenizer import BUILTIN_MODEL, Tokenizer, load_tokenizer
from tests.radixk3.test_tokenizer import TRICKY, gsm8k_test_texts
from tests.radixk3.tiktoken_corpus import MARKER_TEXTS, UNICODE_TEXTS

ASSETS = BUILTIN_MODEL.parent
# sentencepiece never matches its control pieces in text; transformers always matches the tokens its config names
# (bos, eos, unk, pad) wherever they are written, so these four names typed in a text are the one difference.
CONTROL_NAMES = ("<s>", "</s>", "<unk>", "<pad>")
WHITESPACE_TEXTS = ["a" + " " * 17 + "b", " " * 40,
                    "\t" * 9 + " \n" * 5, "x \u00a0\u3000\u2009y  \r\n\r\n  z", "end   "]
U2581_TEXTS = [SPACE_MARK, f"a{SPACE_MARK}b", f" {SPACE_MARK} {SPACE_MARK}{SPACE_MARK}x ", f"{SPACE_MARK}the the"]


@pytest.fixture(scope="module")
def hf() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(ASSETS))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer()


def mixed_texts(tok: Tokenizer, n: int = 400) -> list[str]:
    """Random runs of the vocabulary's own pieces, markers, whitespace and U+2581 (merges across piece borders)."""
    rng = random.Random(0)
    pieces = [p for i in range(tok.vocab_size) if i not in tok.special_ids and (p := tok.decode([i])).isprintable()]
    extra = [" ", "  ", "\t", "\n", SPACE_MARK, "<|im_end|>", "<|separator|>", "<|open|>", "\u00e9", "\U0001f600"]
    return ["".join(rng.choice(pieces if rng.random() < 0.8 else extra) for _ in range(rng.randint(1, 40)))
            for _ in range(n)]


def test_committed_files_are_what_the_writer_writes(tmp_path: Path) -> None:
    write_hf_tokenizer(tmp_path)
    for name in (TOKENIZER_FILE, CONFIG_FILE):
        assert json.loads((ASSETS / name).read_text()) == json.loads((tmp_path / name).read_text()), name


def test_ids_equal_radixk3_and_decode_back(hf: PreTrainedTokenizerBase, tok: Tokenizer) -> None:
    texts = [*gsm8k_test_texts()[:300], *TRICKY, *MARKER_TEXTS, *UNICODE_TEXTS, *WHITESPACE_TEXTS, *U2581_TEXTS,
             *mixed_texts(tok)]
    texts = [t for t in texts if not any(c in t for c in CONTROL_NAMES)]
    assert len(texts) > 700
    for text in texts:
        ids = hf.encode(text, add_special_tokens=False)
        assert ids == tok.encode(text), text
        assert hf.decode(ids) == text == tok.decode(ids, skip_special_tokens=False), text
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids), text


def test_special_ids_and_names(hf: PreTrainedTokenizerBase, tok: Tokenizer) -> None:
    assert len(hf) == tok.vocab_size
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id) == (tok.bos_id, tok.eos_id,
                                                                                    tok.pad_id, 1)
    assert set(hf.all_special_ids) | {i for i, t in hf.added_tokens_decoder.items() if t.special} == tok.special_ids
    chat = "<|im_user|>hi<|im_end|><|im_assistant|><|open|>x<|sep|>y<|close|><|end_of_msg|>"
    assert hf.decode(hf.encode(chat, add_special_tokens=False), skip_special_tokens=True) == "hixy"
    # The one difference (see CONTROL_NAMES): transformers reads a control piece's name as its id.
    for name in CONTROL_NAMES:
        assert hf.encode(f"a{name}b", add_special_tokens=False) == [*tok.encode("a"), tok.piece_to_id(name),
                                                                    *tok.encode("b")]
        assert len(tok.encode(name)) > 1
