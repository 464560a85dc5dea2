"""Well-formed UTF-8 under a grammar. xgrammar (0.2.9) matches a character class against a token's bytes read
as UTF-8, but takes a UTF-8-encoded surrogate (ED A0..BF xx, U+D800..U+DFFF) for a character: a string its
grammar allows can hold bytes no strict decoder accepts, and the client reads three U+FFFD where the grammar
counted one character (a schema's maxLength exceeded). Overlong forms and code points past U+10FFFF it refuses.

So every matcher also walks the bytes it accepts through UTF-8's well-formedness automaton (RFC 3629's
grammar; the states below are the bytes still owed and the range the next one must fall in) and masks out the
tokens that would leave it: the grammar's language intersected with well-formed UTF-8, for every grammar kind.
`Utf8Table` is built once per vocabulary: each state's next state after each token, and each state's packed mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# States: a whole character so far; 1, 2, 3 continuation bytes (80..BF) owed; the restricted second bytes
# after E0 (A0..BF: no overlong), ED (80..9F: no surrogate), F0 (90..BF: no overlong), F4 (80..8F: <= U+10FFFF).
WHOLE, OWE1, OWE2, OWE3, AFTER_E0, AFTER_ED, AFTER_F0, AFTER_F4, REJECT = range(9)
STATES = 8  # the live ones; REJECT absorbs


def transitions() -> np.ndarray:
    """[9, 256] uint8: the state after each byte."""
    t = np.full((9, 256), REJECT, dtype=np.uint8)
    t[WHOLE, 0x00:0x80] = WHOLE
    t[WHOLE, 0xC2:0xE0] = OWE1
    t[WHOLE, 0xE1:0xF0] = OWE2
    t[WHOLE, 0xE0], t[WHOLE, 0xED] = AFTER_E0, AFTER_ED
    t[WHOLE, 0xF1:0xF4] = OWE3
    t[WHOLE, 0xF0], t[WHOLE, 0xF4] = AFTER_F0, AFTER_F4
    t[OWE1, 0x80:0xC0] = WHOLE
    t[OWE2, 0x80:0xC0] = OWE1
    t[OWE3, 0x80:0xC0] = OWE2
    t[AFTER_E0, 0xA0:0xC0] = OWE1
    t[AFTER_ED, 0x80:0xA0] = OWE1
    t[AFTER_F0, 0x90:0xC0] = OWE2
    t[AFTER_F4, 0x80:0x90] = OWE2
    return t


@dataclass(frozen=True)
class Utf8Table:
    """`next_state[s, t]`: the state after token t's bytes from state s (REJECT: ill-formed; an id with no
    bytes, a special one, keeps the state); `masks[s]`: the packed int32 bitmask (bit t % 32 of word t // 32)
    of the tokens allowed from s. Ids past the vocabulary's bytes (the model's padding) are never allowed."""

    next_state: np.ndarray  # [STATES, vocab_size] uint8
    masks: torch.Tensor  # [STATES, words] int32

    @classmethod
    def of(cls, vocab: list[bytes], vocab_size: int) -> Utf8Table:
        import torch

        lengths = np.array([len(b) for b in vocab] + [0] * (vocab_size - len(vocab)), dtype=np.int64)
        flat = np.frombuffer(b"".join(vocab), dtype=np.uint8)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        table = transitions()
        state = np.repeat(np.arange(STATES, dtype=np.uint8)[:, None], vocab_size, axis=1)
        for j in range(int(lengths.max(initial=0))):
            ids = np.nonzero(lengths > j)[0]
            state[:, ids] = table[state[:, ids], flat[starts[ids] + j]]
        state[:, len(vocab):] = REJECT
        words = -(-vocab_size // 32)
        allowed = np.zeros((STATES, words * 32), dtype=bool)
        allowed[:, :vocab_size] = state != REJECT
        packed = np.packbits(allowed, axis=1, bitorder="little").view("<i4")
        return cls(state, torch.from_numpy(packed.astype(np.int32)))


class Utf8Walk:
    """One matcher's walk: the state after each accepted token, so that a rollback restores it."""

    def __init__(self, table: Utf8Table) -> None:
        self._table = table
        self._states = [WHOLE]

    @property
    def mask(self) -> torch.Tensor:
        """The packed mask of the tokens that keep the output well-formed: int32 [words]."""
        return self._table.masks[self._states[-1]]

    def next(self, token: int) -> int:
        """The state after `token` (REJECT if its bytes would make the output ill-formed)."""
        return int(self._table.next_state[self._states[-1], token])

    def push(self, state: int) -> None:
        self._states.append(state)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            del self._states[-num_tokens:]

    def check_integrity(self) -> None:
        assert self._states and self._states[0] == WHOLE and REJECT not in self._states
