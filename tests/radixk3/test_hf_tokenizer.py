"""--tokenizer-mode hf: transformers' AutoTokenizer behind radixk3's interface gives the native tokenizer's ids and
bytes. transformers cannot load a plain tiktoken directory without the checkpoint's own tokenizer code, so the
tokenizer it loads is a `PreTrainedTokenizerFast` converted from the same ranks (transformers' TikTokenConverter,
with Kimi's pattern and the same 256 special tokens) and saved as tokenizer.json: no network, no remote code."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

from radixk3.hf_tokenizer import HfTokenizer
from radixk3.tiktoken_tokenizer import KIMI_PAT_STR, TiktokenTokenizer
from radixk3.tiktoken_writer import write_tiktoken_tokenizer
from radixk3.tokenizer import CHAT_MARKERS, load_tokenizer
from tests.radixk3.test_tokenizer import TRICKY
from tests.radixk3.tiktoken_corpus import LONG_TEXTS, MARKER_TEXTS, corpus


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[TiktokenTokenizer, HfTokenizer]:
    root = tmp_path_factory.mktemp("hf")
    native = load_tokenizer(write_tiktoken_tokenizer(root / "tiktoken"))
    assert isinstance(native, TiktokenTokenizer)
    names = [native.decode([i], skip_special_tokens=False) for i in range(native.base_vocab_size, native.vocab_size)]
    converted = TikTokenConverter(str(root / "tiktoken" / "tiktoken.model"), pattern=KIMI_PAT_STR,
                                  extra_special_tokens=names).converted()
    hf = PreTrainedTokenizerFast(tokenizer_object=converted, bos_token="[BOS]", eos_token="[EOS]",
                                 pad_token="[PAD]", unk_token="[UNK]")
    hf.save_pretrained(str(root / "hf"))
    loaded = load_tokenizer(root / "hf", "hf")
    assert isinstance(loaded, HfTokenizer)
    assert isinstance(load_tokenizer(root / "hf"), HfTokenizer)  # auto: no file radixk3 reads natively
    return native, loaded


def test_layout_equals_native(pair: tuple[TiktokenTokenizer, HfTokenizer]) -> None:
    native, hf = pair
    assert hf.vocab_size == native.vocab_size
    assert hf.special_ids == native.special_ids
    assert (hf.bos_id, hf.eos_id, hf.pad_id) == (native.bos_id, native.eos_id, native.pad_id)
    assert hf.stop_ids == native.stop_ids and hf.has_xtml
    assert hf.max_token_bytes == native.max_token_bytes
    for i in range(hf.vocab_size):
        assert hf.token_bytes(i, skip_special_tokens=False) == native.token_bytes(i, skip_special_tokens=False), i
        assert hf.token_bytes(i) == native.token_bytes(i)


def test_ids_equal_native(pair: tuple[TiktokenTokenizer, HfTokenizer]) -> None:
    """Over the corpus, Kimi's 25,000-character cuts aside (the native path's; a long run only round-trips)."""
    native, hf = pair
    for text in corpus(with_long=False):
        assert hf.encode(text) == native.encode(text), text[:60]
        assert hf.encode_ordinary(text) == native.encode_ordinary(text), text[:60]
    for text in LONG_TEXTS:
        assert hf.decode(hf.encode_ordinary(text)) == text


def test_markers_typed_by_a_user_stay_text(pair: tuple[TiktokenTokenizer, HfTokenizer]) -> None:
    native, hf = pair
    for text in [*MARKER_TEXTS, *CHAT_MARKERS]:
        assert not hf.special_ids.intersection(hf.encode_ordinary(text))
        assert hf.decode(hf.encode_ordinary(text)) == text
    prompt = hf.chat_prompt([{"role": "user", "content": "".join(MARKER_TEXTS)}])
    assert prompt.ids(hf) == prompt.ids(native)


def test_streaming_is_byte_exact(pair: tuple[TiktokenTokenizer, HfTokenizer]) -> None:
    _, hf = pair
    for text in TRICKY[:20]:
        dec = hf.incremental_decoder()
        out = [dec.push(i) for i in hf.encode_ordinary(text)]
        assert not any("\ufffd" in piece for piece in out)
        assert "".join(out) + dec.flush() == text


def test_slow_fallback_cuts_at_markers(pair: tuple[TiktokenTokenizer, HfTokenizer],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A tokenizer class that ignores split_special_tokens (a slow remote class) still never gets a control id
    from text: the text is cut inside each marker name."""
    _, hf = pair
    real = hf.hf.encode

    def ignores_the_flag(text: str, **kwargs: object) -> list[int]:
        kwargs.pop("split_special_tokens", None)
        return real(text, **kwargs)

    monkeypatch.setattr(hf.hf, "encode", ignores_the_flag)
    for text in MARKER_TEXTS:
        ids = hf.encode_ordinary(text)
        assert not hf.special_ids.intersection(ids) and hf.decode(ids) == text
