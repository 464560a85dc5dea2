"""The well-formed-UTF-8 walk every grammar matcher takes (runtime.grammar_utf8), against Python's strict UTF-8
decoder: a byte string is a whole text exactly when it decodes, and is refused exactly when no
continuation could make it decode; a token's transition is the walk over its bytes."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from radixk3.tokenizer import load_tokenizer
from runtime.grammar import GrammarBackend, GrammarKey, fill_masks
from runtime.grammar_utf8 import REJECT, WHOLE, Utf8Table, transitions

TABLE = transitions()


def walk(data: bytes, state: int = WHOLE) -> int:
    for b in data:
        state = int(TABLE[state, b])
    return state


def decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def could_decode(data: bytes) -> bool:
    """Some continuation makes it decode (Python's incremental decoder holds ED A0 as if it could). Only
    continuation bytes complete a character and only the first one's range is constrained, so the ends of those
    ranges (80..8F, 80..9F, 90..BF, A0..BF) are the first bytes worth trying."""
    firsts = (0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF)
    return decodes(data) or any(decodes(data + bytes([c]) + b"\x80" * k) for c in firsts for k in range(3))


def test_every_one_and_two_byte_string() -> None:
    for n in range(2 ** 16):
        for data in (bytes([n >> 8, n & 255]), bytes([n & 255])):
            state = walk(data)
            assert (state == WHOLE) == decodes(data), data
            assert (state != REJECT) == could_decode(data), data


# Lead bytes weighted so that 3- and 4-byte forms (surrogates, overlongs, past U+10FFFF) come up often.
_BYTES = st.one_of(st.integers(0, 255), st.sampled_from([0xE0, 0xED, 0xF0, 0xF4, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF]))


@settings(max_examples=1000, deadline=None, derandomize=True)
@given(st.lists(_BYTES, min_size=1, max_size=8).map(bytes))
def test_longer_strings(data: bytes) -> None:
    state = walk(data)
    assert (state == WHOLE) == decodes(data), data
    assert (state != REJECT) == could_decode(data), data


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.lists(_BYTES, max_size=5).map(bytes), min_size=1, max_size=30), st.lists(_BYTES, max_size=3))
def test_a_tables_transitions_are_the_walk_over_each_tokens_bytes(vocab: list[bytes], start: list[int]) -> None:
    table = Utf8Table.of(vocab, len(vocab) + 5)
    state = walk(bytes(start))
    if state == REJECT:
        return
    words = table.masks[state].numpy()
    for t in range(len(vocab) + 5):
        want = walk(vocab[t], state) if t < len(vocab) else REJECT
        assert table.next_state[state, t] == want
        assert bool((int(words[t // 32]) >> (t % 32)) & 1) == (want != REJECT)


def test_a_json_string_never_holds_an_encoded_surrogate() -> None:
    """xgrammar 0.2.9 allows ED A0 80 (U+D800) inside a JSON string; the matcher lets only ED 80..9F through, and
    what it accepts decodes strictly (a sampled `name` once came back as 'tonscyw' and three U+FFFD)."""
    tok = load_tokenizer()
    byte_token = {tok.token_bytes(t)[0]: t for t in range(tok.vocab_size) if len(tok.token_bytes(t)) == 1}
    backend = GrammarBackend(tok, tok.vocab_size, tok.stop_ids)
    m = backend.matcher(backend.compile(GrammarKey("json_schema", json.dumps({"type": "string", "maxLength": 8}))))

    def allowed() -> set[int]:
        words = fill_masks([m])[0]
        return {t for t in range(tok.vocab_size) if (int(words[t // 32]) >> (t % 32)) & 1}

    assert m.accept(tok.encode('"')[-1]) and m.accept(byte_token[0xED])
    after_ed = allowed()
    assert {tok.token_bytes(t)[0] for t in after_ed} == set(range(0x80, 0xA0))
    assert not m.accept(byte_token[0xA0])  # U+D800
    assert m.accept(byte_token[0x9F]) and m.accept(byte_token[0xBF])  # U+D7FF
    m.rollback(2)
    assert allowed() == after_ed
    text = [tok.encode('"')[-1], byte_token[0xED], byte_token[0x9F], byte_token[0xBF], tok.encode('"')[-1]]
    m.rollback(1)
    assert all(m.accept(t) for t in text[1:]) and m.accept(tok.eos_id) and m.terminated
    assert json.loads(b"".join(tok.token_bytes(t) for t in text).decode()) == "\ud7ff"
    backend.close()


def test_table_of_a_real_vocabulary_is_consistent() -> None:
    tok = load_tokenizer()
    vocab = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    table = Utf8Table.of(vocab, tok.vocab_size + 64)
    for t, data in enumerate(vocab):  # byte-fallback pieces are fragments; special ids have no bytes
        assert (table.next_state[WHOLE, t] == WHOLE) == decodes(data), (t, data)
    assert (table.next_state[:, tok.vocab_size:] == REJECT).all()
    assert np.array_equal(table.next_state[:, list(tok.special_ids)],
                          np.repeat(np.arange(8)[:, None], len(tok.special_ids), axis=1))
