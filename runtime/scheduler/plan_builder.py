"""A step as the scheduler remembers it until its result comes back (`StepRecord`), and the `StepPlan` the
worker gets for it. Physical ids are resolved here, after every allocation of the step (allocations may
compact the pool), so the plan matches the pool after the copies and moves it carries."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kernels.sampling_columns import PARAMETERS, SamplingColumns
from runtime.grammar import GrammarMatcher, fill_masks
from runtime.messages import PlanImage, StepPlan
from runtime.sampling_params import SamplingParams
from runtime.scheduler.output_processor import OutputProcessor
from runtime.scheduler.page_table import PageTables
from runtime.scheduler.pool import UnifiedPool
from runtime.scheduler.request import Req


@dataclass
class SeqEntry:
    req: Req
    start: int  # tokens of the request in the cache before this step
    n: int  # tokens it adds
    sampled: bool
    input_lp_first_none: bool = False  # the request's first prompt token's (absent) logprob is due
    input_lp_positions: list[int] = field(default_factory=list)  # prompt positions whose logprob is computed
    drafts: list[int] = field(default_factory=list)  # verify: draft tokens after the last sampled one (-1: the
    # worker's proposer supplies them); the step samples at every one of the n = 1 + len(drafts) positions


@dataclass
class Checkpoint:
    seq: int  # index into StepRecord.seqs
    pos: int  # the state after this many tokens of the request
    block: int  # virtual state block the worker writes it into


@dataclass
class StepRecord:
    step: int
    mode: str
    seqs: list[SeqEntry]
    ckpts: list[Checkpoint]
    # A decode window (`--num-scheduler-steps`): every sequence feeds one token and the worker runs this many decode
    # steps, so each adds (`n`) and samples this many tokens
    decode_steps: int = 1


def sampling_columns(params: list[SamplingParams], steps: list[int]) -> SamplingColumns:
    """The sampled rows' columns: row i samples output `steps[i]` of a request with parameters `params[i]`."""
    return SamplingColumns.of(len(params), step=steps,
                              **{name: [getattr(p, name) for p in params] for name in (*PARAMETERS, "seed")})


def step_images(req: Req, seq: int, a: int, b: int, base: int) -> list[tuple[PlanImage, np.ndarray]]:
    """The images of `req` whose pad runs meet its new tokens [a, b) (packed from row `base`), each with the slice
    of its rows those tokens take (a chunked prefill may split a run) and its patches."""
    out = []
    for im in req.images:
        r = im.ref
        lo, hi = max(a, r.offset), min(b, r.offset + r.num_tokens)
        if lo < hi:
            out.append((PlanImage(seq, r.content_hash, r.grid, r.num_tokens, base + lo - a, lo - r.offset,
                                  hi - r.offset), im.patches))
    return out


def build_plan(rec: StepRecord, pool: UnifiedPool, tables: PageTables, outputs: OutputProcessor) -> StepPlan:
    for s in rec.seqs:
        tables.sync(s.req)
    table_rows, table_cols, table_pages, resets = tables.drain(pool)
    ids: list[int] = []
    cu, rows, prefix, slots = [0], [], [], []
    sample_rows: list[int] = []
    params: list[SamplingParams] = []  # per sampled row: its request's parameters, and the output index it samples
    steps: list[int] = []
    banned: list[list[int]] = []
    window_stops: list[list[int]] = []
    bias: list[tuple[int, int, float]] = []
    lp_rows: list[tuple[int, int]] = []  # (packed row, next token)
    grammar_rows: list[int] = []
    matchers: list[GrammarMatcher] = []
    images: list[tuple[PlanImage, np.ndarray]] = []
    top_n = 0
    window = rec.decode_steps
    for i, s in enumerate(rec.seqs):
        req = s.req
        fed = 1 if window > 1 else s.n  # a decode window feeds its first token; the worker feeds the rest itself
        a, b = s.start, s.start + fed
        if req.images and a < len(req.prompt_ids):
            images.extend(step_images(req, i, a, b, cu[-1]))
        known = min(b - len(s.drafts), req.known_len)
        ids.extend(req.ids(a, known))
        ids.extend([-1] * (b - len(s.drafts) - known))  # the token being sampled now: the worker feeds it itself
        ids.extend(s.drafts)
        rows.append(req.row)
        prefix.append(a)
        slots.append(pool.state_slot(req.state))  # type: ignore[arg-type]
        base = cu[-1]
        cu.append(base + fed)
        lp_rows.extend((base + pos - 1 - a, req.prompt_ids[pos]) for pos in s.input_lp_positions)
        if s.input_lp_positions:  # the input rows' top logprobs: one width for the step, cut per request
            top_n = max(top_n, req.top_logprobs_num)
        if s.sampled:
            first = req.output_index - window  # its pending samples are counted (a decode window's, all of them)
            if window > 1:  # (a window never crosses min_new_tokens: its stops are banned at every step or none)
                window_stops.append(sorted(outputs.stop_tokens(req) - set(outputs.banned_at(req, first))))
            for j in range(len(s.drafts) + 1):  # a verify window samples at each of its positions
                sample_rows.append(base + fed - 1 - len(s.drafts) + j)
                params.append(req.params)
                steps.append(first + j)
                banned.append(outputs.banned_at(req, first + j))
                bias.extend((len(sample_rows) - 1, t, b) for t, b in req.params.logit_bias)
            if req.grammar is not None:
                # The mask needs every earlier output accepted: no other sample of it may be in flight.
                assert req.pending_samples == 1, f"request {req.rid}: grammar mask planned ahead of its tokens"
                grammar_rows.append(len(sample_rows) - 1)
                matchers.append(req.grammar)
            top_n = max(top_n, req.top_logprobs_num if req.return_logprob else 0)
    ckpt_seq = [c.seq for c in rec.ckpts]
    ckpt_offset = [c.pos - rec.seqs[c.seq].start for c in rec.ckpts]
    ckpt_slot = [pool.state_slot(c.block) for c in rec.ckpts]
    copies = [tuple(c) for c in pool.drain_copies()]
    moves = pool.drain_page_moves()

    def arr(x: list[int]) -> np.ndarray:
        return np.array(x, dtype=np.int64)

    return StepPlan(
        step=rec.step, mode=rec.mode, copies=copies, page_moves=moves, table_rows=table_rows,
        table_cols=table_cols, table_pages=table_pages, rows=arr(rows), prefix_lens=arr(prefix),
        cu_seqlens=arr(cu), state_slots=arr(slots), input_ids=arr(ids), ckpt_seq=arr(ckpt_seq),
        ckpt_offset=arr(ckpt_offset), ckpt_slot=arr(ckpt_slot),
        logits_index=arr(sample_rows + [r for r, _ in lp_rows]), sampling=sampling_columns(params, steps),
        banned=banned, logit_bias=bias, reset_rows=resets, top_logprobs_num=top_n,
        input_logprob_rows=[(len(sample_rows) + i, tok) for i, (_, tok) in enumerate(lp_rows)],
        grammar_rows=arr(grammar_rows), grammar_mask=fill_masks(matchers).reshape(-1),
        images=[im for im, _ in images], decode_steps=window, window_stops=window_stops,
        image_patches=np.concatenate([p for _, p in images]) if images else np.zeros(0, dtype=np.float32),
    )
