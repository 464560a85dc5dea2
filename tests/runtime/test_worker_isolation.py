"""A worker error confined to the request that caused it, through LocalEngine (the Engine's own Scheduler,
StepLoop and ModelWorker): batch-mates finish with exactly their greedy output, nothing leaks; and logprobs
while `min_new_tokens` bans stop tokens are the raw distribution's."""

from __future__ import annotations

import pytest

from radixk3.config import preset
from radixk3.model import build_model
from runtime.local_engine import LocalEngine
from runtime.server_args import ServerArgs
from tests.greedy import greedy_reference

GREEDY = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
POISON = 4000  # a token id whose forward "crashes" the worker in the test below


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return build_model(preset("k3-tiny"), seed=31)


def _prompts() -> list[list[int]]:
    return [list(range(100, 130)), list(range(200, 222)), list(range(300, 340))]


def _tokens(outs: list) -> list[int]:  # noqa: ANN001
    return [t for o in outs for t in o.token_ids]


@pytest.mark.parametrize("overlap", [True, False])
def test_a_failing_forward_fails_only_its_request(model, overlap: bool) -> None:  # noqa: ANN001
    eng = LocalEngine(ServerArgs(disable_overlap_schedule=not overlap), model, check=True)
    real = eng.worker.model.forward_batch

    def crashing(batch, cache):  # noqa: ANN001, ANN202
        out = real(batch, cache)  # the states moved in place before the failure: the worst case
        if bool((batch.input_ids == POISON).any()):
            raise RuntimeError("device fault")
        return out

    eng.worker.model.forward_batch = crashing
    good = _prompts()
    bad = good[1][:10] + [POISON] + good[1][10:]
    rids = [eng.submit(p, GREEDY) for p in good[:2]] + [eng.submit(bad, GREEDY)] + [eng.submit(good[2], GREEDY)]
    outs = eng.run()
    culprit = outs[rids[2]]
    assert culprit[-1].finished == "error" and "device fault" in culprit[-1].error
    for rid, p in zip(rids[:2] + rids[3:], good, strict=True):
        assert outs[rid][-1].finished == "length"
        assert _tokens(outs[rid]) == greedy_reference(model, p, 5)
    s = eng.scheduler
    assert not s.running and not s.waiting
    s.check_integrity()


def test_a_row_that_cannot_be_sampled_fails_alone(model) -> None:  # noqa: ANN001
    eng = LocalEngine(ServerArgs(), model, check=True)
    good = _prompts()
    rids = [eng.submit(p, GREEDY) for p in good]
    # Past the door's checks (as a bug would be): a stop token outside the vocabulary, which the worker is told
    # to ban on this row while it is below min_new_tokens.
    params = next(r for r in eng.scheduler.waiting if r.rid == rids[1]).params
    params.stop_token_ids, params.min_new_tokens = [10**6], 2
    outs = eng.run()
    assert outs[rids[1]][-1].finished == "error" and "sampling failed" in outs[rids[1]][-1].error
    for i in (0, 2):
        assert _tokens(outs[rids[i]]) == greedy_reference(model, good[i], 5)
    eng.scheduler.check_integrity()


def test_logprobs_under_min_new_tokens_are_the_raw_distributions(model) -> None:  # noqa: ANN001
    eng = LocalEngine(ServerArgs(), model, check=True)
    prompt = list(range(500, 530))
    kw = {"return_logprob": True, "top_logprobs_num": 3}
    rid = eng.submit(prompt, GREEDY, **kw)
    free = eng.run()[rid]
    first = free[0].token_ids[0]
    # Ban the greedy first token as a stop token below min_new_tokens: the draw must avoid it, but its
    # reported logprobs stay those of the unmasked distribution.
    rid = eng.submit(prompt, {**GREEDY, "stop_token_ids": [first], "min_new_tokens": 2}, **kw)
    banned = eng.run()[rid]
    assert banned[0].token_ids[0] != first
    raw_top = free[0].top_logprobs[0]
    got_top = banned[0].top_logprobs[0]
    assert [t for t, _ in got_top] == [t for t, _ in raw_top] and raw_top[0][0] == first  # still on top
    assert [lp for _, lp in got_top] == pytest.approx([lp for _, lp in raw_top], abs=1e-4)
    second_lp = next(lp for t, lp in raw_top if t == banned[0].token_ids[0])
    assert banned[0].logprobs[0] == pytest.approx(second_lp, abs=1e-4)


def test_a_decode_step_that_fails_once_is_retried_transparently(model) -> None:  # noqa: ANN001
    """Mid-generation, with outputs already streamed: the retry recomputes prompt + outputs so far and goes
    on, so every request still ends with exactly its greedy output."""
    eng = LocalEngine(ServerArgs(), model, check=True)
    real = eng.worker.model.forward_batch
    decodes = {"n": 0}

    def once(batch, cache):  # noqa: ANN001, ANN202
        out = real(batch, cache)
        if batch.mode.value == "decode":
            decodes["n"] += 1
            if decodes["n"] == 3:
                raise RuntimeError("transient fault")
        return out

    eng.worker.model.forward_batch = once
    prompts = _prompts()
    rids = [eng.submit(p, GREEDY) for p in prompts]
    outs = eng.run()
    assert decodes["n"] > 3
    for rid, p in zip(rids, prompts, strict=True):
        assert outs[rid][-1].finished == "length" and outs[rid][-1].error is None
        assert _tokens(outs[rid]) == greedy_reference(model, p, 5)
    assert all(len(o.token_ids) <= 1 for rid in rids for o in outs[rid])  # streamed token by token, no repeats
    eng.scheduler.check_integrity()
