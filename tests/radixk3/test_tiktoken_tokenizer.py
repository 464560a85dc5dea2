"""Kimi's tiktoken tokenizer: ids equal to tiktoken's own Encoding with Kimi's pattern and cuts, round trips,
streaming without U+FFFD, markers typed by a user staying text, the special-id layout and how a directory's
files pick the tokenizer."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from radixk3.chat_prompt import ChatPrompt
from radixk3.sentencepiece_tokenizer import SentencePieceTokenizer
from radixk3.tiktoken_tokenizer import KIMI_PAT_STR, MAX_RUN_CHARS, TiktokenTokenizer, kimi_pieces
from radixk3.tiktoken_writer import SPECIAL_OFFSETS, TINY_TIKTOKEN_VOCAB_SIZE, write_tiktoken_tokenizer
from radixk3.tokenizer import (
    CHAT_MARKERS,
    END_OF_MSG,
    IM_END,
    XTML_MARKERS,
    RemoteCodeRequired,
    chat_turn,
    load_tokenizer,
)
from tests.radixk3.tiktoken_corpus import (
    LONG_TEXTS,
    MARKER_TEXTS,
    REFERENCE_PAT_STR,
    SURROGATE_TEXTS,
    corpus,
    kimi_cut,
    reference,
    reference_encode,
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiktoken_tokenizer(tmp_path_factory.mktemp("tiktoken"))


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> TiktokenTokenizer:
    t = load_tokenizer(tok_dir)
    assert isinstance(t, TiktokenTokenizer)
    return t


def test_pattern_is_kimis() -> None:
    assert KIMI_PAT_STR == REFERENCE_PAT_STR


def test_cuts_are_kimis() -> None:
    texts = [*LONG_TEXTS, "", " ", "a", " a " * 3, ("a" * 25_000 + " ") * 3, " " * 25_000 + "b" * 25_001,
             "\x1c\x1d\x1e\x1f\x85\xa0\u2028\u3000" * 5_000 + "z"]
    for text in texts:
        assert list(kimi_pieces(text)) == list(kimi_cut(text)), text[:40]
    # The cuts find runs with re's \s, Kimi's loop with str.isspace: the same set of characters.
    spaces = re.compile(r"\s")
    assert all(bool(spaces.match(chr(c))) == chr(c).isspace() for c in range(sys.maxunicode + 1))
    assert max(len(p) for p in kimi_pieces(" " * 60_000)) == MAX_RUN_CHARS


def test_ids_equal_tiktokens_own_encoding(tok: TiktokenTokenizer, tok_dir: Path) -> None:
    ref = reference(tok_dir)
    for text in corpus() + SURROGATE_TEXTS:
        assert tok.encode(text) == reference_encode(ref, text, special=True), text[:60]
        assert tok.encode_ordinary(text) == reference_encode(ref, text, special=False), text[:60]
    assert tok.encode("hi", add_bos=True) == [tok.bos_id, *tok.encode("hi")]


def test_decode_round_trips(tok: TiktokenTokenizer) -> None:
    for text in corpus():
        ids = tok.encode_ordinary(text)
        assert not tok.special_ids.intersection(ids)
        assert tok.decode(ids) == text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    for text in MARKER_TEXTS:
        assert tok.special_ids.intersection(tok.encode(text))  # a raw prompt's markers are control ids


def test_lone_surrogates_become_replacement_characters(tok: TiktokenTokenizer) -> None:
    """As tiktoken (and so Kimi's tokenizer) encodes them: through UTF-16 with replacement."""
    assert tok.decode(tok.encode("lone \ud800 high")) == "lone \ufffd high"
    assert tok.decode(tok.encode("\udfff")) == "\ufffd"
    assert tok.decode(tok.encode("pair \ud83d\ude00")) == "pair \U0001f600"


def test_streaming_never_emits_a_replacement_character(tok: TiktokenTokenizer) -> None:
    for text in corpus(with_long=False):
        ids = tok.encode_ordinary(text)
        dec = tok.incremental_decoder()
        out = []
        for i in ids:
            piece = dec.push(i)
            dec.check_integrity()
            assert "\ufffd" not in piece, (text[:60], i)
            out.append(piece)
        assert "".join(out) + dec.flush() == text
    # A character cut over several byte-level tokens reaches the stream whole.
    emoji = tok.encode_ordinary("\U0001f600")
    assert len(emoji) > 1
    dec = tok.incremental_decoder()
    assert [dec.push(i) for i in emoji] == [""] * (len(emoji) - 1) + ["\U0001f600"]


def test_marker_typed_by_a_user_stays_text(tok: TiktokenTokenizer) -> None:
    names = [tok.decode([i], skip_special_tokens=False) for i in sorted(tok.special_ids)]
    typed = " ".join(names) + "".join(MARKER_TEXTS)
    prompt = tok.chat_prompt([{"role": "system", "content": typed}, {"role": "user", "content": typed,
                                                                      "name": IM_END}])
    ids = prompt.ids(tok)
    placed = [s.text for s in prompt.segments if s.special]
    assert [tok.decode([i], skip_special_tokens=False) for i in ids if i in tok.special_ids] == ["[BOS]", *placed]
    assert tok.decode(ids) == "".join(s.text for s in prompt.segments if not s.special)
    assert not tok.special_ids.intersection(tok.encode_ordinary(typed))
    # Text without marker strings gets the ids of a raw encode of the whole rendered string.
    plain = chat_turn("user", "What is 48 / 2?")
    assert plain.ids(tok, add_bos=False) == tok.encode(plain.text)


def test_special_ids_layout(tok: TiktokenTokenizer, tok_dir: Path) -> None:
    base = TINY_TIKTOKEN_VOCAB_SIZE - 256
    assert tok.vocab_size == TINY_TIKTOKEN_VOCAB_SIZE and tok.base_vocab_size == base
    assert tok.special_ids == frozenset(range(base, base + 256))
    for offset, name in SPECIAL_OFFSETS.items():
        assert tok.special_id(name) == base + offset
        assert tok.token_bytes(base + offset, skip_special_tokens=False) == name.encode()
        assert tok.token_bytes(base + offset) == b""
    assert tok.special_id(f"<|reserved_token_{base + 8}|>") == base + 8
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (base, base + 1, base + 255, base + 254)
    assert tok.stop_ids == (base + 1, tok.special_id(IM_END), tok.special_id(END_OF_MSG))
    assert tok.has_xtml and all(len(tok.encode(m)) == 1 for m in (*CHAT_MARKERS, *XTML_MARKERS))
    assert tok.max_token_bytes == max(len(tok.token_bytes(i, False)) for i in range(tok.vocab_size))
    with pytest.raises(IndexError):
        tok.token_bytes(tok.vocab_size)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert all(base <= int(k) < base + 256 for k in config["added_tokens_decoder"])


def test_chat_prompt_framing(tok: TiktokenTokenizer) -> None:
    prompt = tok.chat_prompt([{"role": "user", "content": "Hi"}])
    assert prompt.text == "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    assert prompt.ids(tok) == [tok.bos_id, *tok.encode(prompt.text)]


def test_a_vocabulary_without_the_framing_markers_refuses_kimi_framing(tmp_path: Path) -> None:
    """K3's vocabulary names no <|im_user|>: the K2 framing cannot be encoded with it, and says so."""
    d = write_tiktoken_tokenizer(tmp_path)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {k: v for k, v in config["added_tokens_decoder"].items()
                                      if v["content"] not in CHAT_MARKERS}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    t = load_tokenizer(d)
    assert t.im_end_id is None and t.stop_ids == (t.eos_id, t.end_of_msg_id)
    with pytest.raises(ValueError, match="not a single token"):
        t.chat_prompt([{"role": "user", "content": "Hi"}]).ids(t)
    assert ChatPrompt.marker("<|open|>").ids(t, add_bos=False) == [t.special_id("<|open|>")]


def test_bad_configs_are_refused(tmp_path: Path) -> None:
    d = write_tiktoken_tokenizer(tmp_path)
    config = json.loads((d / "tokenizer_config.json").read_text())
    for bad, match in (({"added_tokens_decoder": {"5": {"content": "<|x|>"}}}, "special ids"),
                       ({"eos_token": "<|nope|>"}, "not a special token"),
                       ({"bos_token": None}, "no bos_token")):
        (d / "tokenizer_config.json").write_text(json.dumps(config | bad))
        with pytest.raises(ValueError, match=match):
            load_tokenizer(d)
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        load_tokenizer(d)


def test_files_pick_the_tokenizer(tok_dir: Path, tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(tok_dir, "native"), TiktokenTokenizer)
    assert isinstance(load_tokenizer(tok_dir / "tiktoken.model"), TiktokenTokenizer)
    assert isinstance(load_tokenizer(), SentencePieceTokenizer)
    with pytest.raises(FileNotFoundError, match="--tokenizer-mode hf"):
        load_tokenizer(tmp_path, "native")
    # The written config names Kimi's class (auto_map), as the published ones do: hf mode needs remote code.
    with pytest.raises(RemoteCodeRequired, match="--trust-remote-code"):
        load_tokenizer(tok_dir, "hf")
    with pytest.raises(ValueError, match="--tokenizer-mode"):
        load_tokenizer(tok_dir, "slow")
