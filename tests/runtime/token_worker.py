"""A model-free worker for scheduler tests that executes plans exactly as the contract says, on a byte
buffer laid out like the real pool, and checks them as it goes.

Its "model": the KV of a token is the token id, written at the token's physical slot (through its own page
table, renamed by `page_moves`); the "KDA state" of a sequence is (length, rolling hash of its tokens),
written in the state block; the next token is a function of that state. A state read at a prefix must
summarise exactly the tokens the prefix's KV holds (the page table, copies, moves and checkpoints all
agree), or the step fails loudly. Greedy outputs are `reference(prompt, n)` whatever the scheduling.
"""

from __future__ import annotations

import numpy as np

from runtime.messages import StepPlan, StepResult
from runtime.pool_layout import PoolLayout

H0 = 1469598103934665603
MASK = (1 << 61) - 1


def mix(h: int, tok: int) -> int:
    return ((h ^ (tok + 0x9E3779B9)) * 1099511628211) & MASK


def next_token(h: int, vocab: int) -> int:
    return (h >> 7) % vocab


def logprob(h: int, tok: int) -> float:
    return -((h ^ tok) % 997) / 100.0


def reference(prompt: list[int], n: int, vocab: int) -> list[int]:
    h = H0
    for t in prompt:
        h = mix(h, t)
    out = []
    for _ in range(n):
        t = next_token(h, vocab)
        out.append(t)
        h = mix(h, t)
    return out


class TokenWorker:
    def __init__(self, layout: PoolLayout, mem_bytes: int, vocab: int, rows: int) -> None:
        self.g = layout.geometry(mem_bytes)
        self.kv_token_bytes = layout.kv_token_bytes
        self.buf = np.zeros(self.g.total_bytes // 8 + 1, dtype=np.int64)
        self.vocab = vocab
        self.table = np.full((rows, self.g.num_pages + 1), -1, dtype=np.int64)
        self.last = np.full(rows, -1, dtype=np.int64)
        self.history: dict[int, list[int]] = {}
        self.plans: list[StepPlan] = []

    def _kv_word(self, row: int, pos: int) -> int:
        ps = self.g.page_size
        page = int(self.table[row, pos // ps])
        assert page >= 0, f"row {row}: no page for position {pos}"
        return (page * self.g.page_bytes + pos % ps * self.kv_token_bytes) // 8

    def _state_word(self, slot: int) -> int:
        return self.g.state_offset(slot) // 8

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        raw = self.buf.view(np.uint8)
        for src, dst, n in plan.copies:
            raw[dst : dst + n] = raw[src : src + n].copy()
        for src, dst in plan.page_moves:
            self.table[self.table == src] = dst
        self.table[plan.table_rows, plan.table_cols] = plan.table_pages
        for row, hist in plan.reset_rows:
            self.history[row] = list(hist)
            self.last[row] = -1
        row_hash: list[int] = []
        ckpts = {(int(s), int(o)): int(c) for s, o, c in zip(plan.ckpt_seq, plan.ckpt_offset, plan.ckpt_slot,
                                                             strict=True)}
        assert len(ckpts) == len(plan.ckpt_seq), "two checkpoints of one sequence at one offset"
        for i, row in enumerate(plan.rows.tolist()):
            prefix, slot = int(plan.prefix_lens[i]), int(plan.state_slots[i])
            h = H0
            if prefix:
                w = self._state_word(slot)
                length, h = int(self.buf[w]), int(self.buf[w + 1])
                assert length == prefix, f"row {row}: state holds {length} tokens, the prefix is {prefix}"
                kv = H0
                for p in range(prefix):
                    kv = mix(kv, int(self.buf[self._kv_word(row, p)]))
                assert kv == h, f"row {row}: the KV of the prefix disagrees with its state"
            toks = plan.input_ids[plan.cu_seqlens[i] : plan.cu_seqlens[i + 1]].tolist()
            if plan.mode == "decode":
                assert len(toks) == 1 and prefix > 0, "a decode step adds one token on a non-empty prefix"
            for j, t in enumerate(toks):
                if (i, j) in ckpts:
                    self.buf[self._state_word(ckpts[i, j]) : self._state_word(ckpts[i, j]) + 2] = (prefix + j, h)
                if t == -1:
                    t = int(self.last[row])
                    assert t >= 0, f"row {row}: -1 input but nothing was sampled for it"
                self.buf[self._kv_word(row, prefix + j)] = t
                h = mix(h, t)
                row_hash.append(h)
            if (i, len(toks)) in ckpts:
                self.buf[self._state_word(ckpts[i, len(toks)]) : self._state_word(ckpts[i, len(toks)]) + 2] = (
                    prefix + len(toks), h)
            self.buf[self._state_word(slot) : self._state_word(slot) + 2] = (prefix + len(toks), h)
        n = plan.num_sampled
        sample_rows = plan.logits_index[:n].tolist()
        seq_of_row = np.searchsorted(plan.cu_seqlens, np.array(sample_rows), side="right") - 1
        tokens, lps = [], []
        for k, r in enumerate(sample_rows):
            h = row_hash[r]
            banned = set(plan.banned[k])
            t = next_token(h, self.vocab)
            while t in banned:
                t = (t + 1) % self.vocab
            tokens.append(t)
            lps.append(logprob(h, t))
            row = int(plan.rows[seq_of_row[k]])
            self.last[row] = t
            self.history.setdefault(row, []).append(t)
        top_n = plan.top_logprobs_num
        top_ids = [[t] * top_n for t in tokens]
        top_lps = [[lp] * top_n for lp in lps]
        inp = [logprob(row_hash[int(plan.logits_index[r])], tok) for r, tok in plan.input_logprob_rows]
        return StepResult(plan.step, tokens, lps, top_ids, top_lps, inp, input_top_ids=[[tok] * top_n for _, tok in
                                                                                         plan.input_logprob_rows],
                          input_top_logprobs=[[lp] * top_n for lp in inp])
