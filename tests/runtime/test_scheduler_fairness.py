"""Fair prefill, against the model-free TokenWorker: a long prompt prefilling in chunks never stalls the
running decodes (they ride in every step), never keeps a short request from starting (the step's prefill
budget is shared), and `max_prefill_tokens` bounds every step's prefill tokens. Outputs stay exact."""

from __future__ import annotations

import random

import pytest

from runtime.messages import StepPlan, StepResult, TokenOut
from tests.runtime.test_scheduler_plans import GREEDY, VOCAB, Harness, rand, workload
from tests.runtime.token_worker import reference

LONG = 1200
DECODE = {**GREEDY, "max_new_tokens": 80}

CONFIGS = {
    "default": dict(chunked_prefill_size=32),
    "no_overlap": dict(chunked_prefill_size=32, disable_overlap_schedule=True),
    "page16": dict(chunked_prefill_size=32, page_size=16),
    "no_radix": dict(chunked_prefill_size=32, disable_radix_cache=True),
    "budget": dict(chunked_prefill_size=32, max_prefill_tokens=80),
}


def rows_and_lens(plan: StepPlan) -> dict[int, tuple[int, int]]:
    """Each sequence's page-table row -> (its prefix, the tokens the step adds)."""
    lens = [int(b - a) for a, b in zip(plan.cu_seqlens[:-1], plan.cu_seqlens[1:], strict=True)]
    return {int(r): (int(p), n) for r, p, n in zip(plan.rows, plan.prefix_lens, lens, strict=True)}


def start_decodes(h: Harness, prompts: list[list[int]]) -> tuple[list[str], set[int], list[TokenOut]]:
    """Submit `prompts` and step until a plan decodes all of them: their rids, page-table rows and outputs."""
    rids = [h.submit(p, DECODE) for p in prompts]
    outs: list[TokenOut] = []
    while True:
        outs += h.loop.step()
        plan = h.worker.plans[-1] if h.worker.plans else None
        if plan is not None and plan.mode == "decode" and len(plan.rows) == len(prompts):
            return rids, {int(r) for r in plan.rows}, outs


def tokens(outs: list[TokenOut], rid: str) -> list[int]:
    return [t for o in outs if o.rid == rid for t in o.token_ids]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_step_of_a_long_prefill_advances_every_running_decode(name: str) -> None:
    h = Harness(**CONFIGS[name])
    g = random.Random(1)
    shorts = [rand(g, 10), rand(g, 17)]
    rids, rows, early = start_decodes(h, shorts)
    first = len(h.worker.plans)
    long_prompt = rand(g, LONG)
    long_rid = h.submit(long_prompt)
    outs = early + [o for chunks in h.run().values() for o in chunks]
    chunks = 0
    for plan in h.worker.plans[first:]:
        seqs = rows_and_lens(plan)
        prefilling = [p + n for r, (p, n) in seqs.items() if r not in rows and p + n <= LONG and n > 1]
        if prefilling:
            chunks += 1
            assert rows <= set(seqs), f"step {plan.step}: a running decode waits for a prefill chunk"
    assert chunks >= LONG // h.args.step_prefill_budget  # the long prompt really prefilled in many chunks
    assert h.sched.metrics.decode_max_skipped_steps == 0  # what /metrics reports: no decode ever missed a step
    for rid, p in zip(rids, shorts, strict=True):
        assert tokens(outs, rid) == reference(p, 80, VOCAB)
    assert tokens(outs, long_rid) == reference(long_prompt, 6, VOCAB)


def test_without_mixing_decodes_wait_for_the_prefill() -> None:
    """The switch still gives the old schedule: prefill work first, decodes after."""
    h = Harness(chunked_prefill_size=32, enable_mixed_chunk=False)
    g = random.Random(1)
    _, rows, _ = start_decodes(h, [rand(g, 10)])
    first = len(h.worker.plans)
    h.submit(rand(g, LONG))
    h.run()
    stalled = [p for p in h.worker.plans[first:] if p.mode == "extend" and not rows & set(rows_and_lens(p))]
    assert len(stalled) >= LONG // 32
    assert h.sched.metrics.decode_max_skipped_steps >= len(stalled)  # the metric sees the stall, in steps


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_short_request_starts_within_a_step_of_arriving_during_a_long_prefill(name: str) -> None:
    h = Harness(**CONFIGS[name])
    g = random.Random(2)
    long_prompt = rand(g, LONG)
    long_rid = h.submit(long_prompt)
    outs = [o for _ in range(4) for o in h.loop.step()]
    short = rand(g, 6)
    arrived = len(h.worker.plans)
    short_rid = h.submit(short)
    rows_before = set().union(*(set(rows_and_lens(p)) for p in h.worker.plans))
    started = None
    for k in range(3):
        outs += h.loop.step()
        for plan in h.worker.plans[arrived:]:
            new = set(rows_and_lens(plan)) - rows_before
            if new and started is None:
                started = k
        if started is not None:
            break
    assert started is not None and started <= 1, "the short request waited for the long prefill"
    outs += [o for chunks in h.run().values() for o in chunks]
    assert tokens(outs, short_rid) == reference(short, 6, VOCAB)
    assert tokens(outs, long_rid) == reference(long_prompt, 6, VOCAB)


def test_a_stream_of_short_requests_never_starves_the_long_prefill() -> None:
    """A new request arrives at every step: each step still gives the long prompt its share of the budget."""
    h = Harness(chunked_prefill_size=64, max_running_requests=64, mem_bytes=64 << 20)
    g = random.Random(3)
    long_prompt = rand(g, LONG)
    long_rid = h.submit(long_prompt)
    h.loop.step()
    long_row = int(h.worker.plans[0].rows[0]) if h.worker.plans else None
    shorts: dict[str, list[int]] = {}
    outs: dict[str, list] = {}
    while h.loop.busy:
        if len(shorts) < 40:
            p = rand(g, 40)
            shorts[h.submit(p, {**GREEDY, "max_new_tokens": 2})] = p
        for o in h.loop.step():
            outs.setdefault(o.rid, []).append(o)
        h.sched.check_integrity()
        if long_row is None and h.worker.plans:
            long_row = int(h.worker.plans[0].rows[0])
    chunks = [rows_and_lens(p)[long_row] for p in h.worker.plans if long_row in rows_and_lens(p)]
    prefill = [n for p, n in chunks if p + n <= LONG]
    assert sum(prefill) == LONG
    assert all(n >= 32 for n in prefill[:-1]), prefill  # at least its half of the budget, every step
    assert [t for o in outs[long_rid] for t in o.token_ids] == reference(long_prompt, 6, VOCAB)
    for rid, p in shorts.items():
        assert [t for o in outs[rid] for t in o.token_ids] == reference(p, 2, VOCAB)


@pytest.mark.parametrize("overlap", [True, False])
def test_max_prefill_tokens_bounds_every_step(overlap: bool) -> None:
    h = Harness(chunked_prefill_size=32, max_prefill_tokens=48, disable_overlap_schedule=not overlap)
    g = random.Random(4)
    waves = workload()
    waves[0] += [rand(g, 300), rand(g, 150)]
    for wave in waves:
        assert h.generate(wave) == [reference(p, 6, VOCAB) for p in wave]
    full = 0
    for plan in h.worker.plans:
        lens = [n for _, n in rows_and_lens(plan).values()]
        assert max(lens) <= 32  # one request's chunk
        prefill = sum(n for n in lens if n > 1)  # (decode rows and one-token chunks aside)
        assert prefill <= 48
        full += prefill == 48
    assert full > 0  # the budget was full at times, never over


def test_an_isolated_prefill_takes_turns_with_the_decodes() -> None:
    """After a failed step, its requests are retried alone (`isolate`): an isolated request's chunks run in steps
    of their own, so the running decodes get the steps in between instead of waiting for its whole prefill."""
    h = Harness(chunked_prefill_size=32)
    g = random.Random(5)
    short = rand(g, 10)
    (rid,), _, outs = start_decodes(h, [short])
    execute = h.worker.execute
    failed: list[int] = []

    def fail_once(plan: StepPlan) -> StepResult:
        res = execute(plan)
        if not failed and len(plan.rows) > 1:  # the long prompt's first chunk, beside the decode: both retried
            failed.append(plan.step)
            res.error = "boom"
        return res

    h.worker.execute = fail_once  # type: ignore[method-assign]
    long_prompt = rand(g, 400)
    long_rid = h.submit(long_prompt)
    outs += [o for chunks in h.run().values() for o in chunks]
    assert tokens(outs, rid) == reference(short, 80, VOCAB)
    assert tokens(outs, long_rid) == reference(long_prompt, 6, VOCAB)
    plans = [p for p in h.worker.plans if p.step > failed[0]]

    def isolated_chunk(p: StepPlan) -> bool:
        start, n = int(p.prefix_lens[0]), int(p.cu_seqlens[1])
        return len(p.rows) == 1 and n > 1 and p.input_ids.tolist() == long_prompt[start : start + n]

    chunks = [i for i, p in enumerate(plans) if isolated_chunk(p)]
    last_decode = max(i for i, p in enumerate(plans) if p.mode == "decode")
    assert len(chunks) >= 400 // 32 and chunks[-1] < last_decode  # isolated all along, the short still decoding
    assert all(b - a > 1 for a, b in zip(chunks, chunks[1:], strict=False)), "two isolated chunks in a row"
    assert h.sched.metrics.decode_max_skipped_steps == 1  # the decode missed each isolated chunk's step, no more
