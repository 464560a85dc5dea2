"""Scheduler behaviour through LocalEngine: cached-token accounting, logprobs, stops, errors, abort."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixk3.config import preset
from radixk3.model import build_model
from runtime.errors import InvalidRequest
from runtime.local_engine import LocalEngine
from runtime.messages import GenerateReq, decode, encode
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs
from tests.greedy import greedy_reference

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return build_model(preset("k3-tiny"), seed=21)


def _one(eng: LocalEngine, prompt: list[int], params: dict, **kw):  # noqa: ANN202
    rid = eng.submit(prompt, params, **kw)
    return eng.run()[rid]


def test_cached_tokens_follow_the_tree(model) -> None:  # noqa: ANN001
    eng = LocalEngine(ServerArgs(), model, check=True)
    p1 = list(range(10, 50))
    out1 = _one(eng, p1, GREEDY)
    assert out1[-1].cached_tokens == 0
    toks1 = [t for o in out1 for t in o.token_ids]
    # Next turn: the finished request donated its state after prompt + all outputs but the last.
    p2 = p1 + toks1 + [7, 7, 7]
    out2 = _one(eng, p2, GREEDY)
    assert out2[-1].cached_tokens == len(p1) + len(toks1) - 1
    assert [t for o in out2 for t in o.token_ids] == greedy_reference(model, p2, 6)
    # A prompt branching inside p1: KV matches 30 tokens but no state is there yet -> computed, checkpointed.
    p3 = p1[:30] + [1, 2, 3]
    assert _one(eng, p3, GREEDY)[-1].cached_tokens == 0
    # ...so the next request through that branching point hits it.
    p4 = p1[:30] + [4, 5]
    assert _one(eng, p4, GREEDY)[-1].cached_tokens == 30
    # The radix cache off: nothing is ever cached.
    off = LocalEngine(ServerArgs(disable_radix_cache=True), model)
    _one(off, p1, GREEDY)
    assert _one(off, p2, GREEDY)[-1].cached_tokens == 0


def test_logprobs_match_the_full_forward(model) -> None:  # noqa: ANN001
    eng = LocalEngine(ServerArgs(chunked_prefill_size=16), model, check=True)
    prompt = list(range(100, 140))
    _one(eng, prompt, GREEDY)  # cache the prompt, so that logprob_start_len must limit the hit
    outs = _one(eng, prompt, GREEDY, return_logprob=True, logprob_start_len=5, top_logprobs_num=3)
    out_ids = [t for o in outs for t in o.token_ids]
    lp = [x for o in outs for x in o.logprobs]
    inp = [x for o in outs for x in o.input_logprobs]
    top = [x for o in outs for x in o.top_logprobs]
    full = model(torch.tensor(prompt + out_ids)).log_softmax(-1)
    expect_in = [full[j - 1, prompt[j]].item() for j in range(5, len(prompt))]
    assert inp == pytest.approx(expect_in, abs=1e-5)
    expect_out = [full[len(prompt) - 1 + i, t].item() for i, t in enumerate(out_ids)]
    assert lp == pytest.approx(expect_out, abs=1e-5)
    assert [ids for ids, _ in (zip(*row, strict=True) for row in top)][0][0] == out_ids[0]  # greedy = top-1
    assert all(len(row) == 3 for row in top)


def _top(lp: torch.Tensor, k: int) -> list[tuple[int, float]]:
    top = lp.topk(k)
    return list(zip(top.indices.tolist(), top.values.tolist(), strict=True))


def _assert_rows_equal(got: list[list[tuple[int, float]]], expect: list[list[tuple[int, float]]]) -> None:
    assert len(got) == len(expect)
    for g, e in zip(got, expect, strict=True):
        assert [int(t) for t, _ in g] == [t for t, _ in e]
        assert [v for _, v in g] == pytest.approx([v for _, v in e], abs=1e-5)


def test_input_and_output_top_logprobs_match_the_full_forward(model) -> None:  # noqa: ANN001
    """Prompt positions' top-k (SGLang's input_top_logprobs) and the outputs' top-k, as the no-cache forward gives
    them: over chunked prefill, from logprob_start_len, through a cached prompt, and for requests of one batch
    that ask for different k (the step computes the widest, each request gets its own)."""
    eng = LocalEngine(ServerArgs(chunked_prefill_size=16), model, check=True)
    prompt = list(range(200, 240))
    _one(eng, prompt, GREEDY)  # cached: the requests below must recompute the positions they ask for
    asks = [(5, 3), (0, 1), (30, 0)]  # (logprob_start_len, top_logprobs_num)
    rids = [eng.submit(prompt, GREEDY, return_logprob=True, logprob_start_len=start, top_logprobs_num=k)
            for start, k in asks]
    outs = eng.run()
    for rid, (start, k) in zip(rids, asks, strict=True):
        out_ids = [t for o in outs[rid] for t in o.token_ids]
        full = model(torch.tensor(prompt + out_ids)).log_softmax(-1)
        inp_top = [x for o in outs[rid] for x in o.input_top_logprobs]
        assert len(inp_top) == len([x for o in outs[rid] for x in o.input_logprobs]) == len(prompt) - start
        if start == 0:
            assert inp_top[0] is None  # the first token has no context
            inp_top = inp_top[1:]
        first = max(start, 1)
        _assert_rows_equal(inp_top, [_top(full[j - 1], k) for j in range(first, len(prompt))])
        out_top = [x for o in outs[rid] for x in o.top_logprobs]
        _assert_rows_equal(out_top, [_top(full[len(prompt) - 1 + i], k) for i in range(len(out_ids))])


def test_stops_errors_and_abort(model) -> None:  # noqa: ANN001
    eng = LocalEngine(ServerArgs(), model, check=True)
    prompt = list(range(200, 220))
    ref = greedy_reference(model, prompt, 6)
    out = _one(eng, prompt, {**GREEDY, "stop_token_ids": [ref[2]]})
    assert [t for o in out for t in o.token_ids] == ref[:3] and out[-1].finished == "stop"
    assert out[-1].matched_stop == ref[2]
    out = _one(eng, prompt, {**GREEDY, "stop_token_ids": [ref[0]], "min_new_tokens": 2})
    assert len([t for o in out for t in o.token_ids]) >= 2
    with pytest.raises(InvalidRequest, match="temperature"):  # refused at the door, never queued
        eng.submit(prompt, {"temperature": -1})
    with pytest.raises(InvalidRequest, match="max_tokens_typo"):
        eng.submit(prompt, {"max_tokens_typo": 3})
    rid = eng.submit(prompt, {**GREEDY, "max_new_tokens": 50})
    plan = eng.scheduler.schedule()  # admitted, and its first step in flight when the abort arrives
    eng.scheduler.abort(rid)
    first = eng.scheduler.process(eng.worker.execute(plan))
    outs = first + eng.run().get(rid, [])
    assert outs[-1].finished == "abort"
    eng.scheduler.check_integrity()
    assert eng.scheduler.pool.states_used == eng.scheduler.cache.stats().cached_states  # nothing leaked


def test_oversized_request_is_refused_not_spun_on(model) -> None:  # noqa: ANN001
    eng = LocalEngine(ServerArgs(mem_bytes=300_000), model, check=True)
    out = _one(eng, list(range(880)), {**GREEDY, "max_new_tokens": 56})
    assert out[-1].finished == "error" and "capacity" in out[-1].error


def test_bad_inputs_fail_alone(model) -> None:  # noqa: ANN001
    """Refused at the door (LocalEngine.submit, as the tokenizer manager's): the good request runs as if alone."""
    eng = LocalEngine(ServerArgs(), model, check=True)
    good = eng.submit(list(range(20)), GREEDY)
    with pytest.raises(InvalidRequest, match="token ids"):
        eng.submit([1, 10**6], GREEDY)
    with pytest.raises(InvalidRequest, match="seed"):
        eng.submit([1, 2], {**GREEDY, "seed": "abc"})
    with pytest.raises(InvalidRequest, match="top_logprobs_num"):
        eng.submit([1, 2], GREEDY, return_logprob=True, top_logprobs_num=10**6)
    outs = eng.run()
    assert list(outs) == [good]
    assert [t for o in outs[good] for t in o.token_ids] == greedy_reference(model, list(range(20)), 6)


def test_a_failed_step_caches_nothing(model) -> None:  # noqa: ANN001
    """If the worker fails after its forward moved the states, those states must not enter the tree."""
    eng = LocalEngine(ServerArgs(), model, check=True)
    real = eng.worker.execute
    calls = {"n": 0}

    def flaky(plan):  # noqa: ANN001, ANN202
        res = real(plan)  # the forward ran and advanced the live states in place
        calls["n"] += 1
        return dataclasses.replace(res, error="boom")

    eng.worker.execute = flaky  # type: ignore[method-assign]
    prompt = list(range(300, 340))
    out = _one(eng, prompt, GREEDY)
    assert out[-1].finished == "error" and calls["n"] >= 1  # with overlap the next step was already sent
    eng.worker.execute = real  # type: ignore[method-assign]
    again = _one(eng, prompt + [5], GREEDY)
    assert again[-1].cached_tokens == 0
    assert [t for o in again for t in o.token_ids] == greedy_reference(model, prompt + [5], 6)


def test_logprob_bookkeeping_under_retraction_and_min_new_tokens(model) -> None:  # noqa: ANN001
    # Admission reserves no decode tokens (conservativeness 0): decoding outgrows the pool and retracts.
    eng = LocalEngine(ServerArgs(mem_bytes=120_000, chunked_prefill_size=16, schedule_conservativeness=0.0), model,
                      check=True)
    prompts = [list(range(40 * i, 40 * i + 40)) for i in range(1, 4)]
    rids = [eng.submit(p, {**GREEDY, "max_new_tokens": 150}, return_logprob=True, logprob_start_len=0,
                       top_logprobs_num=i) for i, p in enumerate(prompts)]
    outs = eng.run()
    assert eng.scheduler.metrics.retractions > 0
    for i, rid in enumerate(rids):
        inp = [x for o in outs[rid] for x in o.input_logprobs]
        assert len(inp) == 40 and inp[0] is None and None not in inp[1:]
        assert all(len(row) == i for o in outs[rid] for row in o.top_logprobs)
    # min_new_tokens masks the stop tokens until it is reached.
    prompt = list(range(500, 520))
    first = greedy_reference(model, prompt, 1)[0]
    out = _one(LocalEngine(ServerArgs(), model), prompt,
               {**GREEDY, "stop_token_ids": [first], "min_new_tokens": 3})
    toks = [t for o in out for t in o.token_ids]
    assert len(toks) >= 3 and first not in toks[:3]


def test_past_the_door_nothing_parses_or_validates_the_parameters(model, monkeypatch) -> None:  # noqa: ANN001
    """The door's typed parameters cross the wire as they are; the scheduler and the worker never parse or
    validate them again (parsing refused from here on), and the request runs as usual."""
    eng = LocalEngine(ServerArgs(), model, check=True)
    prompt = list(range(600, 630))
    params = SamplingParams.from_dict({**GREEDY, "stop": "never", "seed": 9}, model.config.vocab_size)
    msg = decode(encode(GenerateReq("typed", prompt, params.for_sample(0), return_logprob=True, top_logprobs_num=2)))
    assert msg.sampling == params and isinstance(msg.sampling, SamplingParams)

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("sampling parameters parsed again past the door")

    monkeypatch.setattr(SamplingParams, "from_dict", classmethod(refuse))
    monkeypatch.setattr(SamplingParams, "validate", refuse)
    eng.scheduler.add(msg)
    outs = eng.run()["typed"]
    assert outs[-1].finished == "length" and outs[-1].error is None
    assert [t for o in outs for t in o.token_ids] == greedy_reference(model, prompt, 6)
