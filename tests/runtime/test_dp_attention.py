"""DPAttentionScheduler against one model-free TokenWorker per DP rank: every request gets the reference
greedy tokens whichever group serves it, groups without work get IDLE plans in the same step, aborts reach the
request's group, metrics add up, and every group's pool, tree and in-flight counts stay consistent.
(The engine with real ranks and collectives: tests/runtime/test_engine_parallel.py.)"""

from __future__ import annotations

from collections import deque

import pytest

from radixk3.config import preset
from runtime.messages import GenerateReq, StepPlan, StepResult, TokenOut, combine_metrics, decode, encode
from runtime.pool_layout import pool_layout
from runtime.sampling_params import SamplingParams
from runtime.scheduler.dp_attention import DPAttentionScheduler
from runtime.scheduler.step_loop import StepLoop
from runtime.server_args import ServerArgs
from tests.runtime.test_scheduler_plans import GREEDY, VOCAB, detokenize, workload
from tests.runtime.token_worker import TokenWorker, reference

DP = 2


class Harness:
    def __init__(self, **kw: object) -> None:
        self.args = ServerArgs(tp_size=DP, dp_size=DP, enable_dp_attention=True, **kw)  # type: ignore[arg-type]
        layout = pool_layout(preset("k3-tiny"), self.args)
        self.sched = DPAttentionScheduler(self.args, layout, frozenset({VOCAB - 1}), detokenize, lambda: None)
        self.workers = [TokenWorker(layout, self.args.mem_bytes, VOCAB, self.args.max_running_requests)
                        for _ in range(DP)]
        self._sent: deque[list[StepPlan]] = deque()
        self.loop = StepLoop(self.sched, self._sent.append, self._run, overlap=self.args.overlap_schedule)
        self.idle = [0] * DP
        self._n = 0

    def _run(self) -> list[StepResult]:
        plans = [decode(encode(p)) for p in self._sent.popleft()]  # the wire, as the ranks see it
        for g, p in enumerate(plans):
            self.idle[g] += p.mode == "idle"
        return [w.execute(p) for w, p in zip(self.workers, plans, strict=True)]

    def submit(self, prompt: list[int], sampling: dict | None = None) -> str:
        rid = f"r{self._n}"
        self._n += 1
        self.sched.add(GenerateReq(rid, list(prompt), SamplingParams.from_dict(sampling or GREEDY, VOCAB)))
        return rid

    def run(self) -> dict[str, list[TokenOut]]:
        outs: dict[str, list[TokenOut]] = {}
        while self.loop.busy:
            for o in self.loop.step():
                outs.setdefault(o.rid, []).append(o)
            self.sched.check_integrity()
        return outs


@pytest.mark.parametrize("kw", [dict(), dict(disable_overlap_schedule=True), dict(disable_radix_cache=True),
                                dict(page_size=16, load_balance_method="cache_aware")], ids=str)
def test_every_group_serves_the_reference_greedy_tokens(kw: dict) -> None:
    h = Harness(mem_bytes=4 << 20, **kw)
    for wave in workload():
        rids = [h.submit(p) for p in wave]
        outs = h.run()
        got = [[t for o in outs[r] for t in o.token_ids] for r in rids]
        assert got == [reference(p, GREEDY["max_new_tokens"], VOCAB) for p in wave]
    per = h.sched.group_metrics()
    assert all(m.prompt_tokens > 0 for m in per), "a DP rank was never used"
    total = h.sched.metrics_now()
    assert total.decode_tokens == sum(m.decode_tokens for m in per) > 0
    assert h.sched.router.loads == [0] * DP  # every finished request left the router
    assert h.sched.flush_cache()


def test_a_group_without_work_runs_idle_steps_in_lockstep() -> None:
    h = Harness(mem_bytes=4 << 20, load_balance_method="round_robin")
    short, long = h.submit([1, 2, 3]), h.submit([4, 5, 6], {**GREEDY, "max_new_tokens": 20})
    outs = h.run()
    assert [t for o in outs[short] for t in o.token_ids] == reference([1, 2, 3], 6, VOCAB)
    assert [t for o in outs[long] for t in o.token_ids] == reference([4, 5, 6], 20, VOCAB)
    assert h.idle[0] >= 13 and h.idle[1] == 0  # group 0 idled while group 1 decoded on
    assert len(h.workers[0].plans) == len(h.workers[1].plans)  # one plan per group per step


def test_abort_reaches_the_requests_group() -> None:
    h = Harness(mem_bytes=4 << 20, load_balance_method="round_robin")
    long = {**GREEDY, "max_new_tokens": 200}
    rids = [h.submit([7, 8, 9 + i], long) for i in range(DP)]
    assert [h.sched.router.replica_of(r) for r in rids] == list(range(DP))
    for _ in range(4):
        h.loop.step()
    h.sched.abort(rids[1])
    outs = h.run()
    assert outs[rids[1]][-1].finished == "abort" and outs[rids[0]][-1].finished == "length"
    h.sched.check_integrity()
    assert h.sched.router.loads == [0] * DP


def test_ranks_metrics_add_up_and_high_water_marks_take_the_max() -> None:
    per = [{"steps": 2, "decode_max_skipped_steps": 1}, {"steps": 3, "decode_max_skipped_steps": 0}]
    assert combine_metrics(per) == {"steps": 5, "decode_max_skipped_steps": 1}
