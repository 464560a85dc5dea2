"""The scheduler against the model-free TokenWorker (tests/runtime/token_worker.py), which executes and
checks every plan: page tables, modes, checkpoints, prefix sharing, overlap, plan size."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest

from kernels.sampling_columns import NEUTRAL, PARAMETERS, SamplingColumns
from radixk3.config import preset
from runtime.messages import GenerateReq, StepPlan, StepResult, TokenOut, decode, encode
from runtime.pool_layout import pool_layout
from runtime.sampling_params import SamplingParams
from runtime.scheduler.output_processor import OutputProcessor
from runtime.scheduler.request import Req
from runtime.scheduler.scheduler import Scheduler
from runtime.scheduler.step_loop import StepLoop
from runtime.server_args import ServerArgs
from tests.runtime.token_worker import TokenWorker, reference

VOCAB = 1000
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def detokenize(ids: list[int], skip_special_tokens: bool = True) -> str:
    return "".join(chr(97 + t % 26) for t in ids)


class Harness:
    def __init__(self, **kw: object) -> None:
        self.args = ServerArgs(**kw)  # type: ignore[arg-type]
        layout = pool_layout(preset("k3-tiny"), self.args)
        self.sched = Scheduler(self.args, layout, frozenset({VOCAB - 1}), detokenize)
        self.worker = TokenWorker(layout, self.args.mem_bytes, VOCAB, self.args.max_running_requests)
        self._sent: deque[StepPlan] = deque()
        self.loop = StepLoop(self.sched, self._sent.append, self._run, overlap=not self.args.disable_overlap_schedule)
        self._n = 0

    def _run(self) -> StepResult:
        return self.worker.execute(self._sent.popleft())

    def submit(self, prompt: list[int], sampling: dict | None = None, **kw: object) -> str:
        rid = f"r{self._n}"
        self._n += 1
        params = SamplingParams.from_dict(sampling or GREEDY, VOCAB)
        self.sched.add(GenerateReq(rid, list(prompt), params, **kw))  # type: ignore[arg-type]
        return rid

    def run(self) -> dict[str, list[TokenOut]]:
        outs: dict[str, list[TokenOut]] = {}
        while self.loop.busy:
            for o in self.loop.step():
                outs.setdefault(o.rid, []).append(o)
            self.sched.check_integrity()
        return outs

    def generate(self, prompts: list[list[int]], sampling: dict | None = None) -> list[list[int]]:
        rids = [self.submit(p, sampling) for p in prompts]
        outs = self.run()
        return [[t for o in outs[r] for t in o.token_ids] for r in rids]


def rand(g: random.Random, n: int) -> list[int]:
    return [g.randrange(VOCAB - 1) for _ in range(n)]


def workload(seed: int = 3) -> list[list[list[int]]]:
    g = random.Random(seed)
    shots, system = rand(g, 48), rand(g, 20)
    w1 = [shots + rand(g, g.randrange(3, 12)) for _ in range(8)] + [system + rand(g, g.randrange(2, 30))
                                                                   for _ in range(6)]
    w1 += [rand(g, g.randrange(5, 60)) for _ in range(3)] + [list(w1[0])]
    w2 = [p + reference(p, 6, VOCAB) + rand(g, g.randrange(1, 9)) for p in w1[:8]]
    w2 += [shots[: g.randrange(10, 48)] + rand(g, 4) for _ in range(4)]
    return [w1, w2]


CONFIGS = {
    "plain": dict(),
    "no_overlap": dict(disable_overlap_schedule=True),
    "unmixed": dict(enable_mixed_chunk=False),  # mixing is the default: these two turn it off
    "unmixed_no_overlap": dict(enable_mixed_chunk=False, disable_overlap_schedule=True),
    "no_radix": dict(disable_radix_cache=True),
    "page16_chunked": dict(page_size=16, chunked_prefill_size=32),
    "chunked": dict(chunked_prefill_size=23, decode_checkpoint_interval=4),
    "tiny_pool": dict(mem_bytes=300_000, chunked_prefill_size=40, decode_checkpoint_interval=3),
    "tiny_pool_no_overlap": dict(mem_bytes=300_000, chunked_prefill_size=40, disable_overlap_schedule=True),
    "tiny_pool_page16": dict(mem_bytes=300_000, page_size=16, chunked_prefill_size=48),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_outputs_equal_reference_under_every_schedule(name: str) -> None:
    h = Harness(**CONFIGS[name])
    for wave in workload():
        assert h.generate(wave) == [reference(p, 6, VOCAB) for p in wave]
    m = h.sched.metrics
    assert not h.sched.running and not h.sched.waiting
    if name != "no_radix":
        assert m.cached_tokens > 0 and m.state_hits > 0 and m.checkpoints > 0
    if name.startswith("tiny_pool"):
        assert m.evictions > 0 and h.sched.pool.usage().compaction_moves > 0
    modes = {p.mode for p in h.worker.plans}
    assert modes == {"extend", "decode"}
    if not h.args.enable_mixed_chunk:  # decodes never ride in an extend step (under overlap they would feed -1)
        assert all(-1 not in p.input_ids.tolist() for p in h.worker.plans if p.mode == "extend")
    else:
        assert m.mixed_steps > 0
    if "no_overlap" in name:
        assert all(-1 not in p.input_ids.tolist() for p in h.worker.plans)
    elif name == "plain":
        assert any(-1 in p.input_ids.tolist() for p in h.worker.plans)


def test_overlap_and_mixed_give_identical_greedy_output() -> None:
    results = []
    for kw in (dict(), dict(disable_overlap_schedule=True), dict(enable_mixed_chunk=False)):
        h = Harness(chunked_prefill_size=64, **kw)
        results.append([h.generate(w, {**GREEDY, "max_new_tokens": 12}) for w in workload(9)])
    assert results[0] == results[1] == results[2]


def test_n4_on_one_prompt_computes_it_once() -> None:
    """Four copies of a 200-token prompt: the leader computes 200 tokens and checkpoints at 199; each
    follower then computes only its last token. Ideal: 200 + 3."""
    for overlap in (True, False):
        h = Harness(disable_overlap_schedule=not overlap)
        prompt = rand(random.Random(1), 200)
        assert h.generate([prompt] * 4) == [reference(prompt, 6, VOCAB)] * 4
        assert h.sched.metrics.prefill_tokens_computed == 200 + 3


def test_a_repeat_after_finish_hits_all_but_the_last_token() -> None:
    for ps in (1, 16):
        h = Harness(page_size=ps)
        prompt = rand(random.Random(2), 203)
        h.generate([prompt])
        rid = h.submit(prompt)
        out = h.run()[rid]
        assert out[-1].cached_tokens == (len(prompt) - 1) // ps * ps


def test_burst_with_a_shared_prefix_computes_it_once() -> None:
    """32 requests of 806 shared + 68 own tokens arriving at once: ideal prefill = 806 + 32 * 68 (each token
    once). With 16-token pages a state can only sit at a page boundary, so the followers recompute from
    800: the page-aligned ideal is 874 + 31 * 74."""
    g = random.Random(4)
    shared = rand(g, 806)
    prompts = [shared + rand(g, 68) for _ in range(32)]
    for ps, ideal in ((1, 806 + 32 * 68), (16, 874 + 31 * 74)):
        h = Harness(page_size=ps, mem_bytes=256 << 20)
        assert h.generate(prompts, {**GREEDY, "max_new_tokens": 4}) == [reference(p, 4, VOCAB) for p in prompts]
        assert ideal <= h.sched.metrics.prefill_tokens_computed <= 1.05 * ideal, ps


def test_decode_plan_size_is_o_batch_not_o_context() -> None:
    def decode_plan_ints(batch: int, context: int) -> int:
        h = Harness(mem_bytes=256 << 20, chunked_prefill_size=8192, max_running_requests=batch)
        g = random.Random(batch)
        for _ in range(batch):
            h.submit(rand(g, context), {**GREEDY, "max_new_tokens": 50})
        while not (h.worker.plans and h.worker.plans[-1].mode == "decode" and len(h.worker.plans[-1].rows) == batch):
            h.loop.step()
        for _ in range(3):
            h.loop.step()
        plan = h.worker.plans[-1]
        assert plan.mode == "decode"
        return sum(getattr(plan, a).size for a in StepPlan.ARRAYS) + sum(len(x) for x in plan.banned)

    small, long = decode_plan_ints(8, 64), decode_plan_ints(8, 2048)
    assert small == long  # nothing grows with the context
    assert decode_plan_ints(16, 2048) <= 2 * long + 2


def test_retraction_under_overlap_keeps_outputs_and_logprobs() -> None:
    h = Harness(mem_bytes=120_000, chunked_prefill_size=16, schedule_conservativeness=0.0)  # admit optimistically
    g = random.Random(6)
    prompts = [rand(g, 40) for _ in range(3)]
    rids = [h.submit(p, {**GREEDY, "max_new_tokens": 150}, return_logprob=True, logprob_start_len=0,
                     top_logprobs_num=i) for i, p in enumerate(prompts)]
    outs = h.run()
    assert h.sched.metrics.retractions > 0
    for i, (rid, p) in enumerate(zip(rids, prompts, strict=True)):
        assert [t for o in outs[rid] for t in o.token_ids] == reference(p, 150, VOCAB)
        inp = [x for o in outs[rid] for x in o.input_logprobs]
        assert len(inp) == 40 and inp[0] is None and None not in inp[1:]
        assert all(len(row) == i for o in outs[rid] for row in o.top_logprobs)


def test_stop_string_in_the_tail() -> None:
    h = Harness()
    prompt = rand(random.Random(7), 30)
    ref = reference(prompt, 20, VOCAB)
    text = detokenize(ref)
    stop = text[5:8]
    first = text.find(stop)
    out = h.generate([prompt], {**GREEDY, "max_new_tokens": 20, "stop": [stop, text[15:17]]})[0]
    assert detokenize(out).find(stop) == first and len(out) == first + 3


@pytest.mark.parametrize("kind", ["stop", "stop_regex"])
def test_a_stop_match_ends_in_a_checked_token_and_names_its_place(kind: str) -> None:
    """The scheduler's match: `stop_from_end` is the characters from its start to the end of the output's text.
    An occurrence completed below min_new_tokens (here inside the first check's window) does not stop it."""
    out = OutputProcessor(frozenset(), detokenize)
    ids = [ord(c) - 97 for c in "xbcybcz"]  # one character a token
    stop = {"stop": ["bc"], "stop_regex": "b[a-c]"}[kind]
    req = Req("r", [0], SamplingParams.from_dict({**GREEDY, "max_new_tokens": 7, kind: stop, "min_new_tokens": 4},
                                                 VOCAB))
    reasons = [out.on_token(req, t, 0.0, [], []) for t in ids[:6]]
    assert reasons == [None] * 5 + ["stop"]  # not at "xbcy" (the first check), at "xbcybc"
    assert (req.matched_stop, req.stop_from_end) == (stop[0] if kind == "stop" else stop, 2)
    out.finish(req, "stop")
    assert (out.outbox[-1].token_ids, out.outbox[-1].stop_from_end) == (ids[:6], 2)
    # With no min_new_tokens the first occurrence stops it.
    req = Req("r", [0], SamplingParams.from_dict({**GREEDY, kind: stop}, VOCAB))
    assert [out.on_token(req, t, 0.0, [], []) for t in ids[:3]] == [None, None, "stop"] and req.stop_from_end == 2


def test_mixed_chunk_lets_decodes_ride_in_extend_steps() -> None:
    h = Harness(chunked_prefill_size=16)  # mixing is the default
    g = random.Random(8)
    short = rand(g, 10)
    first = h.submit(short, {**GREEDY, "max_new_tokens": 20})
    early = h.loop.step() + h.loop.step()  # `first` is decoding when the others arrive
    later = [rand(g, 60) for _ in range(3)]
    rids = [h.submit(p) for p in later]
    outs = h.run()
    assert [t for o in early + outs[first] for t in o.token_ids] == reference(short, 20, VOCAB)
    for rid, p in zip(rids, later, strict=True):
        assert [t for o in outs[rid] for t in o.token_ids] == reference(p, 6, VOCAB)
    extend = [p for p in h.worker.plans if p.mode == "extend"]
    assert any(-1 in p.input_ids.tolist() for p in extend)  # a decode of `first` rode along


def test_abort_and_failed_step_under_overlap() -> None:
    h = Harness()
    prompt = rand(random.Random(9), 40)
    rid = h.submit(prompt, {**GREEDY, "max_new_tokens": 50})
    h.loop.step()
    h.loop.step()  # two steps planned, the first processed
    h.sched.abort(rid)
    outs = h.run()[rid]
    assert outs[-1].finished == "abort"
    assert h.sched.pool.states_used == h.sched.cache.stats().cached_states  # nothing leaked
    # Aborted between planning step 2 (which feeds step 1's token as -1) and processing step 1: the token
    # is kept, so what is donated at release matches what the worker computed.
    rid = h.submit(prompt + [1], {**GREEDY, "max_new_tokens": 50})
    h.loop.step()
    plan = h.sched.schedule()
    assert plan is not None and plan.input_ids.tolist() == [-1]
    h._sent.append(plan)
    h.sched.abort(rid)
    h.sched.process(h._run())
    assert h.run()[rid][-1].finished == "abort"
    # The donated state is after the fed token (42 tokens): a prompt one longer than that can use all of it.
    longer = prompt + [1] + reference(prompt + [1], 2, VOCAB)
    again = h.submit(longer, {**GREEDY, "max_new_tokens": 3})
    outs = h.run()[again]
    assert outs[-1].cached_tokens == len(prompt) + 2
    assert [t for o in outs for t in o.token_ids] == reference(longer, 3, VOCAB)
    # A failed step: its requests end with the error and nothing it computed is cached.
    h2 = Harness()
    real = h2.worker.execute

    def failing(plan: StepPlan) -> StepResult:
        res = real(plan)
        res.error = "boom"
        return res

    h2.worker.execute = failing  # type: ignore[method-assign]
    failed = h2.submit(prompt)
    assert h2.run()[failed][-1].finished == "error"
    h2.worker.execute = real  # type: ignore[method-assign]
    again = h2.submit(prompt + [5])
    res = h2.run()[again]
    assert res[-1].cached_tokens == 0
    assert [t for o in res for t in o.token_ids] == reference(prompt + [5], 6, VOCAB)


def test_the_scheduler_process_imports_no_model_code() -> None:
    import subprocess
    import sys

    code = ("import sys, runtime.scheduler_main, runtime.scheduler.scheduler; "
            "bad = sorted(m for m in sys.modules if m.startswith(('radixk3.model', 'radixk3.forward_batch', "
            "'runtime.worker.model_worker', 'kernels.kda', 'kernels.mla', 'kernels.moe', "
            # nor the P/D bootstrap's HTTP stack, which only a P/D server's scheduler runs (half its start-up)
            "'fastapi', 'uvicorn', 'httpx')));"
            " print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_sampling_columns_cross_the_wire_as_each_request_set_them() -> None:
    """Each sampled row's columns, after the wire, are its request's parameters as submitted (a row is matched to
    its request through the page-table row), and its step is the index of the output it samples: 0, 1, ... for
    each request, in order, across rows reused by the next requests."""
    samplings = [
        {**GREEDY, "max_new_tokens": 5},
        {"max_new_tokens": 7, "temperature": 0.7, "top_p": 0.9, "seed": -3, "ignore_eos": True},
        {"max_new_tokens": 4, "top_k": 5, "min_p": 0.1, "seed": 2**63 - 1, "ignore_eos": True},
        {"max_new_tokens": 6, "temperature": 1.3, "frequency_penalty": -0.5, "presence_penalty": 1.5,
         "repetition_penalty": 1.2, "ignore_eos": True},  # unseeded
        {"max_new_tokens": 3, "temperature": 2, "top_p": 1, "seed": 0, "ignore_eos": True},  # ints for floats
    ]
    h = Harness(max_running_requests=2, disable_overlap_schedule=True)
    rids = [h.submit(rand(random.Random(i), 10 + i), sp) for i, sp in enumerate(samplings)]
    of_rid = dict(zip(rids, samplings, strict=True))
    steps: dict[str, list[int]] = {r: [] for r in rids}
    outs: dict[str, list[int]] = {r: [] for r in rids}
    s = h.sched
    while s.has_work:
        plan = s.schedule()
        if plan is None:
            done = s.take_outputs()
        else:
            wire = decode(encode(plan))
            cols = wire.sampling
            assert {n: getattr(cols, n).dtype for n in SamplingColumns.DTYPES} == {
                n: np.dtype(t) for n, t in SamplingColumns.DTYPES.items()}
            owner = {r.row: r.rid for r in s.running}
            seqs = np.searchsorted(wire.cu_seqlens, wire.logits_index[: wire.num_sampled], "right") - 1
            for i, seq in enumerate(seqs.tolist()):
                rid = owner[int(wire.rows[seq])]
                sp = of_rid[rid]
                for name in PARAMETERS:
                    want = np.array(sp.get(name, NEUTRAL[name]), dtype=SamplingColumns.DTYPES[name])
                    assert getattr(cols, name)[i] == want, (rid, name)
                assert bool(cols.seeded[i]) == ("seed" in sp)
                assert "seed" not in sp or int(cols.seed[i]) == sp["seed"]
                steps[rid].append(int(cols.step[i]))
            done = s.process(h.worker.execute(wire))
        for o in done:
            outs[o.rid] += o.token_ids
    for rid, sp in of_rid.items():
        assert len(outs[rid]) == sp["max_new_tokens"] and steps[rid] == list(range(sp["max_new_tokens"])), rid
