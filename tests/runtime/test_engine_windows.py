"""Decode windows (`--num-scheduler-steps`): several decode steps per plan give what a plan per step gives, token for
token (greedy and seeded sampling with penalties, logprobs, min_new_tokens bans, stops inside a window), and a
request that stops inside a window never leaves the tree a state past its kept tokens."""

from __future__ import annotations

import random

import pytest

from radixk3.config import preset
from radixk3.model import build_model
from runtime.local_engine import LocalEngine
from runtime.server_args import ServerArgs
from runtime.tokenizer.engine import Engine
from tests.greedy import greedy_reference

SAMPLED = {"max_new_tokens": 30, "temperature": 0.9, "top_p": 0.9, "top_k": 50, "frequency_penalty": 0.5,
           "repetition_penalty": 1.2, "seed": 7, "ignore_eos": True}


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return build_model(preset("k3-tiny"), seed=11)


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:  # noqa: ANN001
    g = random.Random(3)
    v = model.config.vocab_size
    return [[g.randrange(v) for _ in range(g.randrange(5, 40))] for _ in range(5)]


def _run(model, prompts: list[list[int]], steps: int, sampling: dict, **options) -> tuple[list, LocalEngine]:  # noqa: ANN001, ANN003
    eng = LocalEngine(ServerArgs(num_scheduler_steps=steps, decode_checkpoint_interval=5), model, check=True)
    rids = [eng.submit(p, sampling, **options) for p in prompts]
    outs = eng.run()
    return [([t for o in outs[r] for t in o.token_ids], [x for o in outs[r] for x in o.logprobs],
             [x for o in outs[r] for x in o.top_logprobs], outs[r][-1].finished) for r in rids], eng


@pytest.mark.parametrize("sampling", [
    SAMPLED,
    # stops banned below min_new_tokens (a window ends there), then not; some requests stop inside a window
    SAMPLED | {"max_new_tokens": 32, "min_new_tokens": 6, "ignore_eos": False, "stop_token_ids": list(range(20, 120))},
], ids=["penalties", "min_new_tokens_and_stops"])
def test_windows_sample_what_single_steps_sample(model, prompts: list[list[int]], sampling: dict) -> None:  # noqa: ANN001
    plain, _ = _run(model, prompts, 1, sampling)
    windowed, eng = _run(model, prompts, 8, sampling)
    assert [t for t, *_ in windowed] == [t for t, *_ in plain]
    assert [f for *_, f in windowed] == [f for *_, f in plain]
    m = eng.scheduler.metrics
    assert m.decode_steps > m.steps - m.extend_steps  # windows ran
    if sampling.get("min_new_tokens"):
        assert {f for *_, f in plain} == {"stop", "length"}  # both ends happen, some of them inside a window


def test_a_window_alone_gives_the_same_logprobs(model, prompts: list[list[int]]) -> None:  # noqa: ANN001
    """One request (so the batch of every step is the same either way): its logprobs and top logprobs are bit
    for bit a plan-per-step run's (in a batch they are too, up to the last bits a GEMM over more rows changes)."""
    opts = {"return_logprob": True, "top_logprobs_num": 3}
    assert _run(model, prompts[:1], 6, SAMPLED, **opts)[0] == _run(model, prompts[:1], 1, SAMPLED, **opts)[0]


def test_a_stop_inside_a_window_leaves_no_state_past_it(model, prompts: list[list[int]]) -> None:  # noqa: ANN001
    """Each request stops at a token in the middle of its second window (its state has seen the tokens after it):
    the next turn (prompt + output + more), served from the same tree, equals the no-cache loop."""
    greedy = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    refs = [greedy_reference(model, p, 24) for p in prompts]
    eng = LocalEngine(ServerArgs(num_scheduler_steps=8, decode_checkpoint_interval=3), model, check=True)
    outs = []
    for p, ref in zip(prompts, refs, strict=True):
        at = next(i for i in range(9, 14) if ref[i] not in ref[:i])  # a token first sampled mid-window
        outs.append(eng.generate([p], greedy | {"stop_token_ids": [ref[at]]})[0])
        assert outs[-1] == ref[: at + 1]
    g = random.Random(9)
    turns = [p + o + [g.randrange(model.config.vocab_size) for _ in range(3)] for p, o in zip(prompts, outs,
                                                                                              strict=True)]
    assert eng.generate(turns, greedy | {"max_new_tokens": 8}) == [greedy_reference(model, t, 8) for t in turns]
    assert eng.scheduler.metrics.cached_tokens > 0


def test_a_request_arriving_during_a_window_waits_for_its_end(model, prompts: list[list[int]]) -> None:  # noqa: ANN001
    """With the overlap scheduler (the default), requests submitted while a window runs start after it: nothing is
    planned behind a window (its last samples are its requests' next inputs), and every output is the no-cache
    loop's."""
    greedy = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    later = list(prompts[1:])
    rids: list[str] = []

    def arrive(s) -> None:  # noqa: ANN001
        if later and s.steps_in_flight and s._inflight[-1].decode_steps > 1:
            rids.append(eng.submit(later.pop(0), greedy))

    eng = LocalEngine(ServerArgs(num_scheduler_steps=6), model, check=True, on_step=arrive)
    first = eng.submit(prompts[0], greedy)
    outs = eng.run()
    assert not later, "every prompt arrives while a window is in flight"
    got = [[t for o in outs[r] for t in o.token_ids] for r in [first, *rids]]
    assert [o[-1].finished for o in outs.values()] == ["length"] * len(prompts)
    assert got == [greedy_reference(model, p, 20) for p in prompts]


def _spy(plan_window, fits: list[bool]):  # noqa: ANN001, ANN202
    """`Scheduler._window_batch`, recording whether each window fitted."""
    def window(n: int):  # noqa: ANN202
        rows = plan_window(n)
        fits.append(rows is not None)
        return rows
    return window


def test_a_window_never_retracts_a_request(model) -> None:  # noqa: ANN001
    """A pool that a plan per step gets through without retracting anything (requests stopping early give their
    pages back in time) but that cannot hold every row's next window at some step: there a window gives way to a
    single step instead of retracting a request (which the old window did), and windows still run where they fit."""
    g = random.Random(3)
    prompts = [[g.randrange(model.config.vocab_size) for _ in range(g.randrange(5, 40))] for _ in range(8)] * 2
    greedy = {"max_new_tokens": 40, "temperature": 0, "stop_token_ids": list(range(100, 260))}
    tight = dict(mem_bytes=220_000, page_size=4, chunked_prefill_size=40, schedule_conservativeness=0.0,
                 enable_mixed_chunk=False, disable_radix_cache=True)
    refs = [greedy_reference(model, p, 40, stop_ids=frozenset(greedy["stop_token_ids"])) for p in prompts]
    runs = {}
    fits: list[bool] = []
    for steps in (1, 8):
        eng = LocalEngine(ServerArgs(num_scheduler_steps=steps, **tight), model, check=True)
        eng.scheduler._window_batch = _spy(eng.scheduler._window_batch, fits)
        assert eng.generate(prompts, greedy) == refs
        runs[steps] = eng.scheduler.metrics
    assert {len(r) for r in refs} >= {1, 7, 32}, "requests stop early and late"
    assert runs[1].retractions == 0 and runs[8].retractions == 0
    assert not all(fits), "some window did not fit: a single step ran instead"
    assert runs[8].decode_steps > runs[8].steps - runs[8].extend_steps  # windows ran where they fit


def test_a_window_that_cannot_fit_evicts_nothing(model) -> None:  # noqa: ANN001
    """A window the pool cannot hold even by evicting every cached node is refused before a page is taken: the
    cached prefixes stay (the old window evicted them first, then gave way). Asked between steps, once requests
    decode beside a cache holding the first round's prefixes, for a window far larger than the pool."""
    g = random.Random(5)
    prompts = [[g.randrange(model.config.vocab_size) for _ in range(24)] for _ in range(4)]
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    eng = LocalEngine(ServerArgs(num_scheduler_steps=4, mem_bytes=2 << 20, page_size=4,
                                 disable_overlap_schedule=True), model, check=True)
    eng.generate(prompts[:2], greedy)  # their prefixes stay cached
    seen: list[tuple[bool, int, int]] = []

    def ask_for_a_huge_window(s) -> None:  # noqa: ANN001
        if s.cache.stats().cached_pages and any(s._decodable(r) for r in s.running):
            before = s.cache.stats()
            rows = s._window_batch(1 << 20)
            after = s.cache.stats()
            seen.append((rows is None, after.evicted_pages - before.evicted_pages, after.cached_pages))

    eng.on_step = ask_for_a_huge_window
    refs = [greedy_reference(model, p, 12) for p in prompts[2:]]
    assert eng.generate(prompts[2:], greedy) == refs
    assert seen and all(refused and evicted == 0 and cached > 0 for refused, evicted, cached in seen)


def test_stop_strings_and_streams_through_the_engine(builtin_engine: Engine) -> None:
    """The multi-process Engine with windows: the plans and results cross the wire; stop strings found inside a
    window cut the text where a plan per step cuts it, streamed or read whole."""
    prompt = "Natalia sold clips to"
    greedy = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    text = builtin_engine.generate(prompt, greedy)["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cases = [greedy, greedy | {"stop": stop}, SAMPLED | {"max_new_tokens": 40, "n": 2}]
    def seen(out: dict | list) -> list:
        outs = out if isinstance(out, list) else [out]
        return [(o["text"], o["output_ids"], o["meta_info"]["finish_reason"]) for o in outs]

    with Engine(mem_bytes=8 << 20, num_scheduler_steps=6) as eng:
        for params in cases:
            assert seen(eng.generate(prompt, params)) == seen(builtin_engine.generate(prompt, params))
        for params in cases[:2]:
            streamed = list(eng.stream(prompt, params))
            assert "".join(c.text for c in streamed) == builtin_engine.generate(prompt, params)["text"]
