"""The watchdog's parts without processes (issue 27): the scheduler's clock over its steps, the tokenizer side's
watch over silent schedulers, and the scheduler failing every request while a step is stuck, then consuming
that step's late result (against the model-free TokenWorker, which checks every plan it runs)."""

from __future__ import annotations

import random

import pytest

from runtime.messages import StepPlan, TokenOut
from runtime.scheduler.watchdog import StepWatchdog
from runtime.server_args import ServerArgs
from runtime.tokenizer.scheduler_watch import SchedulerWatch
from tests.runtime.test_dp_attention import Harness as DPHarness
from tests.runtime.test_scheduler_plans import VOCAB, Harness, rand
from tests.runtime.token_worker import reference

STUCK = "watchdog: worker rank 0 of replica 0 did not finish a step within 3 s (--watchdog-timeout)"


def test_the_flag_takes_seconds_and_zero_turns_it_off() -> None:
    assert ServerArgs().watchdog_timeout == 300  # SGLang's default
    assert ServerArgs(watchdog_timeout=3).heartbeat_interval == pytest.approx(0.6)
    assert ServerArgs().heartbeat_interval == 1.0
    assert not StepWatchdog(ServerArgs(watchdog_timeout=0).watchdog_timeout, 1.0).enabled
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="watchdog-timeout must be >= 0"):
            ServerArgs(watchdog_timeout=bad)


def test_a_step_overdue_fires_once_and_stays_stuck_until_every_step_is_back() -> None:
    w = StepWatchdog(3.0, 0.6)
    w.sent(10.0)
    w.sent(10.5)  # overlap: planned while the first runs
    assert w.overdue(12.9) is None
    assert w.came_back(12.9) is False
    assert w.overdue(15.8) is None  # the second step's clock started when the first came back
    assert w.overdue(16.0) == pytest.approx(3.1)
    w.stuck = STUCK
    assert w.overdue(30.0) is None  # fired once
    w.sent(30.0)  # (a step sent while stuck: the scheduler sends none, but the clock would hold)
    assert w.came_back(40.0) is False and w.stuck == STUCK  # one step is still outstanding
    assert w.came_back(41.0) is True and w.stuck is None
    assert w.overdue(100.0) is None


def test_the_watchdog_sleeps_until_its_next_heartbeat_or_deadline() -> None:
    w = StepWatchdog(3.0, 0.6)
    assert w.beat_due(0.0)
    w.beaten(0.0)
    assert not w.beat_due(0.5) and w.beat_due(0.6)
    assert w.wait_s(0.1) == pytest.approx(0.5)
    w.sent(3.0)  # its deadline: 6.0
    w.beaten(5.0)
    assert w.wait_s(5.5) == pytest.approx(0.1)  # the next beat (5.6) first
    w.beaten(5.8)
    assert w.wait_s(5.9) == pytest.approx(0.1)  # the deadline first
    off = StepWatchdog(0.0, 1.0)
    off.sent(0.0)
    assert off.wait_s(100.0) is None and off.overdue(100.0) is None and not off.beat_due(100.0)


def test_a_silent_scheduler_is_stuck_only_while_it_owes_news() -> None:
    watch = SchedulerWatch(2, 3.0, now=0.0)
    name = lambda i: f"the scheduler of replica {i} (pid 7, stopped)"  # noqa: E731
    assert watch.check({}, 100.0, name) == []  # idle for long: nothing is owed
    assert watch.check({1: 4}, 101.0, name) == []  # requests pending from now on
    watch.heard(0, None, 103.0)
    assert watch.check({0: 1, 1: 4}, 103.9, name) == []
    assert watch.check({0: 1, 1: 4}, 104.2, name) == [1]  # replica 1 has said nothing for 3.2 s
    assert watch.stuck is not None and "the scheduler of replica 1 (pid 7, stopped) sent nothing for 3.2 s" \
        in watch.stuck and "4 request(s) pending" in watch.stuck
    assert watch.check({0: 1, 1: 4}, 110.0, name) == [0]  # reported once each
    watch.heard(1, None, 111.0)
    watch.heard(0, STUCK, 111.0)  # alive, but its ranks are stuck
    assert watch.silent == [None, None] and watch.stuck == STUCK
    watch.heard(0, None, 112.0)
    assert watch.stuck is None


def _final(outs: list[TokenOut]) -> dict[str, TokenOut]:
    return {o.rid: o for o in outs if o.finished is not None}


@pytest.mark.parametrize("cfg", [dict(), dict(disable_overlap_schedule=True),
                                 dict(mem_bytes=300_000, chunked_prefill_size=40, decode_checkpoint_interval=3)],
                         ids=["overlap", "no_overlap", "tiny_pool"])
def test_a_stuck_step_fails_every_request_and_its_late_result_is_consumed(cfg: dict) -> None:
    """The watchdog fires with steps in flight: every request (running, queued) fails with its error at once;
    those in a step in flight keep their memory until that step comes back; the late results are then
    processed and discarded, the bookkeeping holds, nothing leaks, and the engine serves exactly again."""
    g = random.Random(5)
    h = Harness(**cfg)
    shared = rand(g, 30)
    prompts = [shared + rand(g, g.randrange(3, 20)) for _ in range(10)] + [rand(g, 50) for _ in range(4)]
    long = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    rids = [h.submit(p, long) for p in prompts]
    outs: list[TokenOut] = []
    for _ in range(6):
        outs += h.loop.step()
        h.sched.check_integrity()
    # The ranks stop: the step the loop left in flight (overlap) and one more planned never come back for now.
    held: list[StepPlan] = list(h._sent)
    h._sent.clear()
    if (plan := h.sched.schedule()) is not None:
        held.append(plan)
    rids += [h.submit(rand(g, 12), long) for _ in range(2)]  # arrived meanwhile: queued
    assert held and h.sched.waiting
    in_flight = [r for r in h.sched.running if r.in_flight]
    held_states = {r.rid: r.state for r in in_flight}
    outs += h.sched.fail_all(STUCK)
    final = _final(outs)
    assert sorted(final) == sorted(rids)  # every request heard, at once
    assert all(o.finished == "error" and o.error == STUCK for o in final.values())
    assert not h.sched.waiting
    # Memory a stuck step may still write stays with its requests.
    assert {r.rid: r.state for r in h.sched.running} == held_states
    h.sched.check_integrity()
    for plan in held:  # the ranks resume: the late results come in order
        late = h.sched.process(h.worker.execute(plan))
        assert not [o for o in late if o.token_ids or o.finished]  # discarded
        h.sched.check_integrity()
    h.run()  # settles what is left
    assert not h.sched.running and not h.sched.has_work
    assert h.sched.flush_cache()
    assert h.sched.pool.pages_used == 0 and h.sched.pool.states_used == 0  # nothing leaked
    again = [shared + rand(g, 5), prompts[-1]]
    assert h.generate(again) == [reference(p, 6, VOCAB) for p in again]  # and it serves exactly again


def test_dp_attention_fails_every_group_and_consumes_the_late_steps() -> None:
    h = DPHarness(mem_bytes=4 << 20, load_balance_method="round_robin")
    g = random.Random(6)
    long = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    rids = [h.submit(rand(g, 20), long) for _ in range(6)]
    outs: list[TokenOut] = []
    for _ in range(4):
        outs += h.loop.step()
    held = list(h._sent)
    h._sent.clear()
    if (plans := h.sched.schedule()) is not None:
        held.append(plans)
    assert held
    outs += h.sched.fail_all(STUCK)
    assert sorted(_final(outs)) == sorted(rids) and h.sched.router.loads == [0, 0]
    for plans in held:
        results = [w.execute(p) for w, p in zip(h.workers, plans, strict=True)]
        assert not [o for o in h.sched.process(results) if o.token_ids or o.finished]
        h.sched.check_integrity()
    h.run()
    assert h.sched.flush_cache()
    assert all(s.pool.pages_used == 0 and s.pool.states_used == 0 for s in h.sched.groups)
    prompt = rand(g, 9)
    rid = h.submit(prompt)
    assert [t for o in h.run()[rid] for t in o.token_ids] == reference(prompt, 6, VOCAB)
