"""Fair prefill through the scheduler and the real worker (k3-tiny): greedy outputs equal the plain no-cache
loop while running decodes ride in a long prompt's prefill steps (the default), under retraction, and with
speculation, where verify steps and extend steps take turns (a verify window cannot share an extend step)."""

from __future__ import annotations

import random

import pytest

from radixk3.config import preset
from radixk3.model import build_model
from runtime.local_engine import LocalEngine
from runtime.messages import StepPlan, StepResult, TokenOut
from runtime.server_args import ServerArgs
from tests.greedy import greedy_reference

LONG = 300


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return build_model(preset("k3-tiny"), seed=13)


def recording(eng: LocalEngine) -> list[StepPlan]:
    """The plans the worker runs, in order."""
    plans: list[StepPlan] = []
    run = eng.worker.execute

    def execute(plan: StepPlan) -> StepResult:
        plans.append(plan)
        return run(plan)

    eng.worker.execute = execute  # type: ignore[method-assign]
    return plans


def tokens(outs: list[TokenOut], rid: str) -> list[int]:
    return [t for o in outs if o.rid == rid for t in o.token_ids]


Started = tuple[list[str], str, set[int], int, list[TokenOut]]


def long_prompt_during_decodes(eng: LocalEngine, plans: list[StepPlan], shorts: list[list[int]],
                               long_prompt: list[int], new: int) -> Started:
    """Start `shorts` decoding (`new` tokens each), then submit `long_prompt`: the rids, the shorts' page-table
    rows, the index in `plans` (recorded) of the first plan after the long prompt arrived, and every output."""
    greedy = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    rids = [eng.submit(p, greedy) for p in shorts]
    outs: list[TokenOut] = []
    while not (plans and plans[-1].mode != "extend" and len(plans[-1].rows) == len(shorts)):
        outs += eng.loop.step()
    rows = {int(r) for r in plans[-1].rows}
    first = len(plans)
    long_rid = eng.submit(long_prompt, {**greedy, "max_new_tokens": 4})
    outs += [o for chunks in eng.run().values() for o in chunks]
    return rids, long_rid, rows, first, outs


def prefill_rows(plan: StepPlan, decode_rows: set[int]) -> list[int]:
    lens = (plan.cu_seqlens[1:] - plan.cu_seqlens[:-1]).tolist()
    return [int(r) for r, n in zip(plan.rows, lens, strict=True) if int(r) not in decode_rows and n > 1]


def test_decodes_ride_in_a_long_prefill_and_stay_exact(model) -> None:  # noqa: ANN001
    eng = LocalEngine(ServerArgs(chunked_prefill_size=32), model, check=True)
    plans = recording(eng)
    g = random.Random(1)
    v = model.config.vocab_size
    shorts = [[g.randrange(v) for _ in range(n)] for n in (9, 14)]
    long_prompt = [g.randrange(v) for _ in range(LONG)]
    rids, long_rid, rows, first, outs = long_prompt_during_decodes(eng, plans, shorts, long_prompt, 24)
    chunks = [i for i in range(first, len(plans)) if prefill_rows(plans[i], rows)]
    assert len(chunks) >= LONG // 32
    finish = max(i for i, p in enumerate(plans) if rows & {int(r) for r in p.rows})  # the shorts' last decode
    assert all(rows <= {int(r) for r in plans[i].rows} for i in chunks if i <= finish)
    assert finish > chunks[-1]  # the shorts decoded through the whole prefill
    for rid, p in zip(rids, shorts, strict=True):
        assert tokens(outs, rid) == greedy_reference(model, p, 24)
    assert tokens(outs, long_rid) == greedy_reference(model, long_prompt, 4)
    assert eng.scheduler.metrics.mixed_steps >= LONG // 32 - 1
    assert eng.scheduler.metrics.decode_max_skipped_steps == 0


def test_speculation_takes_turns_with_a_long_prefill(model) -> None:  # noqa: ANN001
    """Verify steps cannot carry prefill chunks: no decode waits for more than one extend step."""
    eng = LocalEngine(ServerArgs(chunked_prefill_size=32, speculative_algorithm="ngram", debug_spec_state=True),
                      model, check=True)
    plans = recording(eng)
    g = random.Random(2)
    v = model.config.vocab_size
    motif = [g.randrange(v) for _ in range(5)]
    shorts = [motif * 3, [g.randrange(v) for _ in range(11)]]  # a repeat: the lookup finds drafts
    long_prompt = [g.randrange(v) for _ in range(LONG)]
    rids, long_rid, rows, first, outs = long_prompt_during_decodes(eng, plans, shorts, long_prompt, 40)
    tail = plans[first:]
    chunks = [i for i, p in enumerate(tail) if prefill_rows(p, rows)]
    assert len(chunks) >= LONG // 32
    for a, b in zip(chunks, chunks[1:], strict=False):
        between = tail[a + 1 : b]
        finished = all(rows.isdisjoint({int(r) for r in p.rows}) for p in tail[a + 1 :])
        assert finished or any(rows & {int(r) for r in p.rows} for p in between), \
            f"plans {a} and {b}: two extend steps in a row while decodes wait"
    assert all(p.mode == "extend" for i, p in enumerate(tail) if i in chunks)
    assert eng.scheduler.metrics.verify_steps > 0 and eng.scheduler.metrics.mixed_steps == 0
    assert eng.scheduler.metrics.decode_max_skipped_steps == 1  # turns: a decode misses one extend step, no more
    for rid, p in zip(rids, shorts, strict=True):
        assert tokens(outs, rid) == greedy_reference(model, p, 40)
    assert tokens(outs, long_rid) == greedy_reference(model, long_prompt, 4)


def test_retraction_with_decodes_riding_in_prefill_steps(model) -> None:  # noqa: ANN001
    # Admission reserves no decode tokens (conservativeness 0): decoding outgrows the pool and retracts.
    eng = LocalEngine(ServerArgs(mem_bytes=120_000, chunked_prefill_size=16, schedule_conservativeness=0.0), model,
                      check=True)
    g = random.Random(3)
    v = model.config.vocab_size
    prompts = [[g.randrange(v) for _ in range(n)] for n in (40, 52, 45, 60)]
    greedy = {"max_new_tokens": 80, "temperature": 0, "ignore_eos": True}
    assert eng.generate(prompts, greedy) == [greedy_reference(model, p, 80) for p in prompts]
    m = eng.scheduler.metrics
    assert m.retractions > 0 and m.mixed_steps > 0
