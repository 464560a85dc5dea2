"""Regression tests, through the multi-process Engine, for each fault issue 10 observed: bad parameters that
passed the door and failed a whole step, silent negative indexing, loose types, streams and timeouts that
left requests running, stale or blocking metrics, no request id at submit time, no incremental text, a
thread hop per async chunk, the script without a `__main__` guard, and masked logprobs; and (issue 13) a
--tp 2 rank that dies or hangs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from radixk3.config import preset
from radixk3.model import build_model
from runtime.errors import InvalidRequest
from runtime.tokenizer.engine import Engine, EngineError
from tests.greedy import greedy_reference

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def engine(builtin_engine: Engine) -> Engine:
    return builtin_engine


@pytest.fixture(scope="module")
def model(engine: Engine):  # noqa: ANN201
    return build_model(preset("k3-tiny"), seed=engine.args.seed)


def _idle(engine: Engine, timeout: float = 5.0) -> dict:
    """Metrics once nothing runs or waits; fails unless that happens within `timeout`, far sooner than a LONG
    request could finish by itself."""
    deadline = time.monotonic() + timeout
    while True:
        m = engine.get_metrics()
        if m["running"] == 0 and m["queued"] == 0:
            return m
        assert time.monotonic() < deadline, f"requests still running: {m}"
        time.sleep(0.05)


def test_a_bad_request_never_fails_its_batch_mates(engine: Engine, model) -> None:  # noqa: ANN001
    prompts = [list(range(100, 120)), list(range(300, 330))]
    streams = [engine.stream(p, GREEDY) for p in prompts]  # in flight while the bad ones arrive
    for bad in ({"stop_token_ids": [4103]}, {"top_k": 2**63}, {"top_k": 2**70}):
        with pytest.raises(InvalidRequest) as e:
            engine.generate(prompts[0], GREEDY | bad)
        assert e.value.param in bad
    for p, s in zip(prompts, streams, strict=True):
        chunks = list(s)
        assert chunks[-1].finished == "length" and chunks[-1].error is None
        assert [t for c in chunks for t in c.token_ids] == greedy_reference(model, p, 6)
    assert engine.get_metrics()["pending_requests"] == 0  # nothing refused was left registered


def test_negative_stop_ids_are_refused_not_wrapped(engine: Engine, model) -> None:  # noqa: ANN001
    prompt = list(range(40, 60))
    with pytest.raises(InvalidRequest, match="stop_token_ids"):
        engine.generate(prompt, GREEDY | {"stop_token_ids": [-1769]})
    assert engine.generate(prompt, GREEDY)["output_ids"] == greedy_reference(model, prompt, 6)


@pytest.mark.parametrize(("params", "field", "word"), [
    ({"n": 0}, "n", "n must"), ({"n": -3}, "n", "n must"), ({"n": 2.7}, "n", "integer"), ({"n": "2"}, "n", "integer"),
    ({"seed": "abc"}, "seed", "integer"), ({"temperature": float("inf")}, "temperature", "finite"),
])
def test_loose_types_are_refused(engine: Engine, params: dict, field: str, word: str) -> None:
    with pytest.raises(InvalidRequest, match=word) as e:
        engine.generate("x", GREEDY | params)
    assert e.value.param == field
    with pytest.raises(InvalidRequest):
        engine.stream("x", GREEDY | params)
    assert engine.get_metrics()["pending_requests"] == 0


def test_stream_yields_all_n_samples_with_text(engine: Engine) -> None:
    params = {"max_new_tokens": 5, "temperature": 1.0, "seed": 7, "n": 3, "ignore_eos": True}
    chunks = list(engine.stream("Weng earns", params))
    assert sorted({c.index for c in chunks}) == [0, 1, 2]
    assert sum(c.finished is not None for c in chunks) == 3
    want = engine.generate("Weng earns", params)
    for i, w in enumerate(want):
        mine = [c for c in chunks if c.index == i]
        assert [t for c in mine for t in c.token_ids] == w["output_ids"]  # seeded: the same samples
        assert "".join(c.text for c in mine) == w["text"] and w["text"]


def test_streamed_text_is_incremental_and_stops_are_trimmed(engine: Engine) -> None:
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = engine.generate("Natalia sold", params)
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    chunks = list(engine.stream("Natalia sold", params | {"stop": stop}))
    assert all(stop not in c.text for c in chunks)
    assert "".join(c.text for c in chunks) == text[: text.index(stop)]
    assert chunks[-1].finished == "stop" and chunks[-1].matched_stop == stop
    assert sum(bool(c.text) for c in chunks) > 1  # text arrives as it is produced, not at the end


def test_closing_or_dropping_a_stream_aborts_it(engine: Engine) -> None:
    it = engine.stream(list(range(10, 30)), LONG)
    next(it)
    it.close()
    _idle(engine)
    it = engine.stream(list(range(10, 30)), LONG)
    next(it)
    del it  # garbage-collected
    _idle(engine)


def test_cancelling_an_async_stream_aborts_it(engine: Engine) -> None:
    async def consume(got: asyncio.Event) -> None:
        async for _ in engine.async_stream(list(range(10, 30)), LONG):
            got.set()

    async def main() -> None:
        got = asyncio.Event()
        task = asyncio.create_task(consume(got))
        await asyncio.wait_for(got.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _idle(engine)


def test_a_generate_timeout_aborts_every_request_of_the_batch(engine: Engine) -> None:
    prompts = [list(range(10, 20)), list(range(20, 30)), list(range(30, 40))]
    with pytest.raises(TimeoutError, match="produced nothing"):
        engine.generate(prompts, LONG, timeout=1e-4)  # per chunk: the first cannot come that soon
    assert _idle(engine)["running"] == 0


def test_a_deadline_bounds_the_whole_request(engine: Engine) -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="deadline"):
        engine.generate(list(range(10, 30)), LONG, deadline=0.5)
    assert time.monotonic() - start < 10
    _idle(engine)


def test_metrics_replies_are_never_stale(engine: Engine) -> None:
    before = _idle(engine)
    with pytest.raises(TimeoutError):
        engine.get_metrics(timeout=0)  # its reply comes late and must be dropped
    engine.generate("x", GREEDY)
    after = engine.get_metrics()
    assert after["steps"] > before["steps"]


def test_running_is_zero_after_an_abort_with_nothing_else_running(engine: Engine) -> None:
    _idle(engine)
    rid = engine.submit(list(range(50, 70)), LONG)[0]
    time.sleep(0.3)
    engine.abort(rid)
    (res,) = engine.wait([rid], timeout=30)
    assert res["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine.get_metrics()["running"] == 0


def test_submit_returns_ids_at_once_and_generate_can_be_aborted_by_id(engine: Engine) -> None:
    rids = engine.submit("Hello", GREEDY | {"n": 2}, rid="mine")
    assert rids == ["mine-0", "mine-1"]
    assert [r["meta_info"]["id"] for r in engine.wait(rids)] == rids
    done: list = []
    t = threading.Thread(target=lambda: done.append(engine.generate(list(range(60, 80)), LONG, rid="gen-1")))
    t.start()
    time.sleep(0.5)
    engine.abort("gen-1")
    t.join(timeout=30)
    assert done[0]["meta_info"]["finish_reason"]["type"] == "abort"


class _NoThreads(concurrent.futures.ThreadPoolExecutor):
    def submit(self, *a, **kw):  # noqa: ANN002, ANN003, ANN204
        raise AssertionError("a chunk hopped to a thread")


def test_async_streams_need_no_thread_per_chunk(engine: Engine) -> None:
    async def one(i: int) -> list[int]:
        return [t async for c in engine.async_stream([5 + i, 6, 7], GREEDY) for t in c.token_ids]

    async def main() -> list[list[int]]:
        asyncio.get_running_loop().set_default_executor(_NoThreads())
        return await asyncio.gather(*(one(i) for i in range(20)))

    outs = asyncio.run(main())
    assert all(len(o) == 6 for o in outs)
    assert outs[0] == engine.generate([5, 6, 7], GREEDY)["output_ids"]


def test_logprobs_under_min_new_tokens_are_raw(engine: Engine) -> None:
    kw = {"return_logprob": True, "top_logprobs_num": 2}
    free = engine.generate("Natalia sold", GREEDY, **kw)
    first = free["output_ids"][0]
    banned = engine.generate("Natalia sold", GREEDY | {"stop_token_ids": [first], "min_new_tokens": 2}, **kw)
    assert banned["output_ids"][0] != first
    top = banned["meta_info"]["output_top_logprobs"][0]  # (logprob, token id, text) triples, as SGLang's
    assert top[0][1] == first and top[0][0] == pytest.approx(free["meta_info"]["output_top_logprobs"][0][0][0],
                                                             abs=1e-4)


def test_after_shutdown_calls_fail_at_once() -> None:
    eng = Engine(mem_bytes=4 << 20)
    eng.shutdown()
    start = time.monotonic()
    with pytest.raises(EngineError, match="shut down"):
        eng.get_metrics(timeout=30)
    with pytest.raises(EngineError, match="shut down"):
        eng.abort("r0")
    with pytest.raises(EngineError, match="shut down"):
        eng.generate("x", GREEDY)
    assert time.monotonic() - start < 10  # at once: not after get_metrics's 30-s timeout


UNGUARDED = """
from runtime.tokenizer.engine import Engine
engine = Engine(mem_bytes=4 << 20)
print(engine.generate("Hello", {"max_new_tokens": 3, "temperature": 0})["output_ids"])
engine.shutdown()
"""


def test_a_script_without_a_main_guard_runs(tmp_path) -> None:  # noqa: ANN001
    script = tmp_path / "snippet.py"
    script.write_text(UNGUARDED)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=os.environ | {"PYTHONPATH": ROOT}, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert len(eval(res.stdout.strip().splitlines()[-1])) == 3


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_dead_or_hung_rank_fails_the_whole_engine_fast(how: str) -> None:
    """--tp 2: rank 1 SIGKILLed, or SIGSTOPped (a hang: rank 0's collective times out after --dist-timeout).
    Every pending request fails with an error naming the rank, within a bound; no process is left behind."""
    timeout_s = 5.0
    eng = Engine(mem_bytes=8 << 20, tp_size=2, dist_timeout=timeout_s)
    try:
        pids = [p.pid for p in eng.procs.procs]
        streams = [eng.stream(list(range(20 + i, 60 + i)), LONG, timeout=120) for i in range(3)]
        for s in streams:
            next(s)  # all three running
        os.kill(eng.procs.worker(0, 1).pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        start = time.monotonic()
        for s in streams:
            with pytest.raises(EngineError) as failed:
                for _ in s:
                    pass
            assert "rank 1 of replica 0" in str(failed.value)
        assert time.monotonic() - start < (10 if how == "kill" else timeout_s + 15)
        if how == "stop":
            assert "stopped" in str(failed.value) and "collective failed" in str(failed.value)
        else:
            assert "rank 1 of replica 0 exited with code -9 (SIGKILL)" in str(failed.value)
        eng.procs.watcher.join(timeout=30)
        deadline = time.monotonic() + 15
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(p) for p in pids), "a process was left behind"
        with pytest.raises(EngineError):
            eng.generate("again", {"max_new_tokens": 1})
    finally:
        eng.shutdown()
