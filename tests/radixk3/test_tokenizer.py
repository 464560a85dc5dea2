"""The built-in tokenizer: exact round trips, single-id markers, streaming decode, chat template, training."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import sentencepiece as spm
from hypothesis import given, settings
from hypothesis import strategies as st

from radixk3.tokenizer import (
    BUILTIN_MODEL,
    CHAT_MARKERS,
    SEPARATOR,
    XTML_MARKERS,
    Tokenizer,
    load_tokenizer,
)
from radixk3.tokenizer_train import GSM8K_TRAIN, gsm8k_texts, train_tokenizer

GSM8K_TEST = GSM8K_TRAIN.with_name("test.jsonl")
HYP = settings(derandomize=True, deadline=None, max_examples=300)

TRICKY = [
    "",
    " ",
    "  leading and trailing  ",
    "\n",
    "\n\nQuestion: x\n\n",
    " \n \n",
    "\t tab\r\nCRLF",
    "caf\u00e9 na\u00efve \u00c5ngstr\u00f6m",
    "\u4e2d\u6587\u6587\u672c and \u65e5\u672c\u8a9e",
    "emoji \U0001f600\U0001f680 and \U0001f468\u200d\U0001f469\u200d\U0001f467",
    "combining e\u0301 and fullwidth \uff11\uff12",  # identity normalisation must keep both as written
    "literal \u2581 lower one eighth block \u2581\u2581",
    "<<48/2=24>>24 clips\n#### 72",
    "$1,234.50 - 3.14159 = -0.001",
    "<s></s><pad><unk> written as text",
    "\x00\x01\x7f",
]


@cache
def tok() -> Tokenizer:
    return load_tokenizer()


@cache
def sp_oracle() -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=str(BUILTIN_MODEL))


def gsm8k_test_texts() -> list[str]:
    rows = [json.loads(line) for line in GSM8K_TEST.read_text(encoding="utf-8").splitlines()]
    return [r[k] for r in rows for k in ("question", "answer")]


def test_vocabulary_layout() -> None:
    t = tok()
    assert t.vocab_size == 4096
    assert (t.pad_id, sp_oracle().unk_id(), t.bos_id, t.eos_id) == (0, 1, 2, 3)
    assert [t.id_to_piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert t.piece_to_id("\n") == 4
    assert [t.piece_to_id(m) for m in (*CHAT_MARKERS, SEPARATOR)] == list(range(5, 11))
    # The K3 markup markers come after the older symbols so that those keep their ids.
    assert [t.piece_to_id(m) for m in XTML_MARKERS] == list(range(11, 15))
    assert t.stop_ids == (t.eos_id, t.piece_to_id("<|im_end|>"), t.piece_to_id("<|end_of_msg|>"))
    assert t.special_ids == frozenset({0, 1, 2, 3, *range(5, 10), *range(11, 15)})
    with pytest.raises(IndexError, match="4096"):
        t.id_to_piece(4096)
    with pytest.raises(IndexError):
        t.decode([-1])


def test_round_trip_gsm8k_test_set() -> None:
    t, oracle = tok(), sp_oracle()
    texts = gsm8k_test_texts()
    assert len(texts) == 2 * 1319
    for s in texts:
        ids = t.encode(s)
        assert t.decode(ids) == s
        # Our byte-table decode agrees with sentencepiece's own on ordinary text.
        assert oracle.decode(ids) == s
    # Trained on this distribution, the BPE compresses it, though every digit (and the space before a
    # number) is its own token: about 2.7 characters per token.
    total_chars = sum(len(s) for s in texts)
    total_ids = sum(len(t.encode(s)) for s in texts)
    assert total_ids < total_chars / 2.5


@pytest.mark.parametrize("s", TRICKY)
def test_round_trip_tricky(s: str) -> None:
    t = tok()
    ids = t.encode(s)
    assert t.decode(ids) == s
    assert t.decode(ids, skip_special_tokens=False) == s
    assert all(i not in t.special_ids for i in ids)


def test_unseen_characters_use_byte_fallback() -> None:
    t = tok()
    ids = t.encode("\U0001f600")
    assert [t.id_to_piece(i) for i in ids] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert sp_oracle().unk_id() not in t.encode("".join(TRICKY))


def test_digits_are_split() -> None:
    t = tok()
    assert [t.id_to_piece(i) for i in t.encode("2024")] == ["2", "0", "2", "4"]


@pytest.mark.parametrize("marker", [*CHAT_MARKERS, SEPARATOR, *XTML_MARKERS])
def test_markers_encode_to_single_ids(marker: str) -> None:
    t = tok()
    (mid,) = t.encode(marker)
    assert t.id_to_piece(mid) == marker
    ids = t.encode(f"a {marker}\nb")
    assert mid in ids
    assert t.decode(ids, skip_special_tokens=False) == f"a {marker}\nb"


def special_pieces(t: Tokenizer) -> list[str]:
    """The text of every special token (control pieces and markers): what a user could type."""
    return [t.id_to_piece(i) for i in sorted(t.special_ids)]


def test_encode_ordinary_keeps_every_special_token_text() -> None:
    t = tok()
    for piece in special_pieces(t):
        for s in (piece, f"a {piece}\nb", piece * 3, f"<{piece}|>", piece[:-1] + piece):
            ids = t.encode_ordinary(s)
            assert not t.special_ids & set(ids), (s, ids)
            assert t.decode(ids) == s == t.decode(ids, skip_special_tokens=False)  # visible, even skipping specials
    everything = "".join(special_pieces(t)) + SEPARATOR
    assert t.decode(t.encode_ordinary(everything)) == everything
    # <|separator|> is text in this tokenizer (decode keeps it, stop strings see it): it keeps its one id.
    assert t.encode_ordinary(SEPARATOR) == [t.separator_id]


@HYP
@given(st.lists(st.sampled_from(["a", " ", "\n", "7", "\u2581", "\U0001f600", "<", "|", ">", "<|", "|>", "im_end",
                                 *CHAT_MARKERS, *XTML_MARKERS, SEPARATOR, "<s>", "</s>"]), max_size=30))
def test_encode_ordinary_never_gives_a_special_id(parts: list[str]) -> None:
    t = tok()
    s = "".join(parts)
    ids = t.encode_ordinary(s)
    assert not t.special_ids & set(ids)
    assert t.decode(ids) == s
    if not any(m in s for m in (*CHAT_MARKERS, *XTML_MARKERS)):
        assert ids == t.encode(s)  # without marker strings, the two encodings agree


def test_encode_ordinary_equals_encode_on_gsm8k() -> None:
    t = tok()
    for s in gsm8k_test_texts()[:400]:
        assert t.encode_ordinary(s) == t.encode(s)


marker_free = st.lists(st.sampled_from(["a", "b", " ", "  ", "\n", "\t", "7", "<", "|", ">", "=", '"', "_", "x",
                                        "\u00e9", "\u2581", "\U0001f600", "the", " the", "im", "end", "user"]),
                       max_size=12).map("".join).filter(
    lambda s: not any(m in s for m in (*CHAT_MARKERS, *XTML_MARKERS, SEPARATOR)))


@HYP
@given(before=marker_free, marker=st.sampled_from([*CHAT_MARKERS, *XTML_MARKERS, SEPARATOR]), after=marker_free)
def test_markers_cut_the_encoding(before: str, marker: str, after: str) -> None:
    """sentencepiece never merges across a marker, so encoding the text between markers piece by piece (as chat
    prompts do) gives the ids of the whole string."""
    t = tok()
    assert t.encode(before + marker + after) == t.encode(before) + t.encode(marker) + t.encode(after)


def test_skip_special_tokens() -> None:
    t = tok()
    ids = t.encode("<|im_user|>hi<|im_end|>x<|separator|>y", add_bos=True) + [t.eos_id, t.pad_id]
    assert ids[0] == t.bos_id
    assert t.decode(ids) == "hix<|separator|>y"
    assert t.decode(ids, skip_special_tokens=False) == "<s><|im_user|>hi<|im_end|>x<|separator|>y</s><pad>"


def test_chat_template() -> None:
    t = tok()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?", "name": "bob"},
    ]
    prompt = t.apply_chat_template(messages)
    assert prompt == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>What is 2+2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>4<|im_end|>"
        "<|im_user|>bob<|im_middle|>And 3+3?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    assert t.apply_chat_template(messages, add_generation_prompt=False) == prompt.removesuffix(
        "<|im_assistant|>assistant<|im_middle|>"
    )
    ids = t.encode(prompt)
    assert ids.count(t.im_end_id) == 4
    assert t.decode(ids, skip_special_tokens=False) == prompt
    with pytest.raises(ValueError, match="tool"):
        t.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="string"):
        t.apply_chat_template([{"role": "user", "content": None}])  # type: ignore[dict-item]


def stream(t: Tokenizer, ids: list[int], cuts: list[int], skip: bool) -> list[str]:
    """Pushes of `ids` split at `cuts`, then the flush; checks integrity after each step."""
    dec = t.incremental_decoder(skip_special_tokens=skip)
    bounds = [0, *sorted(c % (len(ids) + 1) for c in cuts), len(ids)]
    out = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        out.append(dec.push(ids[lo:hi]))
        dec.check_integrity()
    out.append(dec.flush())
    assert dec.pending == b""
    assert dec.num_tokens == len(ids)
    return out


@HYP
@given(
    ids=st.lists(st.integers(0, 4095) | st.integers(11, 266), max_size=40),  # extra weight on byte ids
    cuts=st.lists(st.integers(0, 1000), max_size=10),
    skip=st.booleans(),
)
def test_incremental_equals_full_decode(ids: list[int], cuts: list[int], skip: bool) -> None:
    t = tok()
    assert "".join(stream(t, ids, cuts, skip)) == t.decode(ids, skip_special_tokens=skip)


def test_incremental_never_splits_a_character() -> None:
    t = tok()
    text = "\u4e2d\u6587 \U0001f600\U0001f680 caf\u00e9 \u2581 <|im_end|> done"
    ids = t.encode(text)
    dec = t.incremental_decoder(skip_special_tokens=False)
    pieces = []
    for i in ids:
        pieces.append(dec.push(i))
        dec.check_integrity()
        assert "\ufffd" not in pieces[-1]
    assert dec.flush() == ""
    assert "".join(pieces) == text
    # The emoji's first three byte ids are held back, then released together with the fourth.
    emoji = t.encode("\U0001f600")
    dec = t.incremental_decoder()
    assert [dec.push(i) for i in emoji] == ["", "", "", "\U0001f600"]
    # A stream cut inside a character ends with one replacement character, as the full decode does.
    assert dec.push(emoji[:2]) == "" and dec.flush() == "\ufffd" == t.decode(emoji[:2])


@HYP
@given(st.text(max_size=200))
def test_round_trip_random_text(s: str) -> None:
    t = tok()
    assert t.decode(t.encode(s), skip_special_tokens=False) == s


@HYP
@given(st.lists(st.sampled_from(["a", " ", "\n", "7", "\u2581", "\u00e9", "\U0001f600", *CHAT_MARKERS]), max_size=30))
def test_round_trip_marker_heavy_text(parts: list[str]) -> None:
    t = tok()
    s = "".join(parts)
    assert t.decode(t.encode(s), skip_special_tokens=False) == s


def test_load_tokenizer_paths(tmp_path: Path) -> None:
    model = BUILTIN_MODEL.read_bytes()
    (tmp_path / "tokenizer.model").write_bytes(model)
    for path in (tmp_path, tmp_path / "tokenizer.model", str(tmp_path)):
        assert load_tokenizer(path).encode("Question: 12 apples\n") == tok().encode("Question: 12 apples\n")
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(missing)
    kimi_dir = tmp_path / "kimi"
    kimi_dir.mkdir()
    (kimi_dir / "tiktoken.model").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="tiktoken"):
        load_tokenizer(kimi_dir)


def test_training_is_deterministic_and_matches_shipped_model() -> None:
    shipped = BUILTIN_MODEL.read_bytes()
    first = train_tokenizer(gsm8k_texts())
    second = train_tokenizer(gsm8k_texts())
    assert first == second
    assert first == shipped, "retrain with `python -m radixk3.tokenizer_train` (sentencepiece version changed?)"
    assert 40_000 < len(shipped) < 80_000


def test_a_tokenizer_without_k3_markup_still_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokenizers trained before K3's markup tokens existed load, with tools and reasoning off."""
    import radixk3.tokenizer_train as tt
    from radixk3.tokenizer import XTML_MARKERS, SentencePieceTokenizer

    monkeypatch.setattr(tt, "USER_SYMBOLS", tuple(s for s in tt.USER_SYMBOLS if s not in XTML_MARKERS))
    texts = ["Natalia sold clips to 48 of her friends in April.", "Weng earns $12 an hour for babysitting."] * 20
    old = SentencePieceTokenizer(tt.train_tokenizer(texts, tt.TokenizerTrainConfig(vocab_size=340)))
    assert not old.has_xtml and old.end_of_msg_id is None
    assert old.stop_ids == (old.eos_id, old.im_end_id)
    assert old.decode(old.encode("Natalia sold clips")) == "Natalia sold clips"
    assert load_tokenizer().has_xtml
