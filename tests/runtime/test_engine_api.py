"""The asyncio engine API as the HTTP server uses it: a TokenizerManager on its own event loop (here the
Engine's loop thread), RequestHandle streams and results, aborts by every way a consumer can go away,
overload, flush, model info and shutdown."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Coroutine
from typing import Any

import pytest

from runtime.errors import InvalidRequest
from runtime.scheduler.output_processor import NON_STREAM_INTERVAL
from runtime.tokenizer.engine import Engine, EngineError, EngineOverloaded
from runtime.tokenizer.manager import TokenizerManager

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(builtin_engine: Engine) -> Engine:
    return builtin_engine


def on_loop(engine: Engine, coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a test coroutine on the loop the tokenizer manager runs on."""
    return engine._call(coro)


async def idle(tm: TokenizerManager, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = await tm.get_metrics()
        if m["running"] == 0 and m["queued"] == 0 and m["pending_requests"] == 0:
            return m
        assert time.monotonic() < deadline, f"requests still running: {m}"
        await asyncio.sleep(0.05)


def test_submit_stream_and_result(engine: Engine) -> None:
    tm = engine.tm

    async def run() -> None:
        h = tm.submit("Weng earns", GREEDY | {"n": 2, "temperature": 1.0, "seed": 5}, rid="a")
        assert h.rids == ["a-0", "a-1"]
        chunks = [c async for c in h.stream()]
        assert [c.index for c in chunks if c.finished] and sorted(c.index for c in chunks if c.finished) == [0, 1]
        again = await tm.submit("Weng earns", GREEDY | {"n": 2, "temperature": 1.0, "seed": 5},
                                return_logprob=True).result()
        plain = await tm.submit("Weng earns", GREEDY | {"n": 2, "temperature": 1.0, "seed": 5}).result()
        # SGLang's shape: the logprob fields only when asked for, the rest always.
        assert [r["output_ids"] for r in plain] == [r["output_ids"] for r in again]
        assert all(set(r["meta_info"]) == {"id", "finish_reason", "prompt_tokens", "completion_tokens",
                                           "cached_tokens", "error"} for r in plain)
        for i, r in enumerate(again):
            mine = [c for c in chunks if c.index == i]
            assert r["output_ids"] == [t for c in mine for t in c.token_ids]
            assert r["text"] == "".join(c.text for c in mine)
            assert mine[-1].completion_tokens == 6 and mine[-1].prompt_tokens == r["meta_info"]["prompt_tokens"]
            assert set(r["meta_info"]) >= {"id", "finish_reason", "prompt_tokens", "completion_tokens",
                                           "cached_tokens", "error", "output_token_logprobs",
                                           "input_token_logprobs", "output_top_logprobs"}
        with pytest.raises(RuntimeError, match="once"):
            [c async for c in h.stream()]

    on_loop(engine, run())


def test_a_request_read_whole_comes_in_few_chunks(engine: Engine) -> None:
    """A request whose consumer reads only the result (`stream=False`, what `Engine.generate` and the HTTP
    server's non-streamed requests send) gets its first token at once, then its tokens every NON_STREAM_INTERVAL
    and at the end: the same tokens and logprobs as a streamed one."""
    tm = engine.tm
    params = GREEDY | {"max_new_tokens": 2 * NON_STREAM_INTERVAL + 20}

    async def run() -> tuple[list, list]:
        (whole,) = tm.send([tm.prepare("Weng earns", params, return_logprob=True, stream=False)])
        streamed = tm.submit("Weng earns", params, return_logprob=True)
        return [c async for c in whole.stream()], [c async for c in streamed.stream()]

    whole, streamed = on_loop(engine, run())
    assert [len(c.token_ids) for c in whole if c.token_ids] == [1, NON_STREAM_INTERVAL, NON_STREAM_INTERVAL, 19]
    assert len([c for c in streamed if c.token_ids]) > 3
    for field in ("token_ids", "logprobs"):
        assert [x for c in whole for x in getattr(c, field)] == [x for c in streamed for x in getattr(c, field)]
    assert "".join(c.text for c in whole) == "".join(c.text for c in streamed)
    assert engine.generate("Weng earns", params)["output_ids"] == [t for c in streamed for t in c.token_ids]
    with pytest.raises(TypeError, match="Engine.stream"):  # SGLang's generate(stream=True) is `stream` here
        engine.generate("Weng earns", GREEDY, stream=True)
    rids = engine.submit(list(range(10, 30)), LONG, timeout=1e-6)  # a per-chunk timeout: kept (streamed)
    with pytest.raises(TimeoutError):  # at once; had submit dropped it, wait would return the whole LONG reply
        engine.wait(rids)


def test_logprobs_with_text(engine: Engine) -> None:
    tm = engine.tm

    async def run() -> dict:
        h = tm.submit([1, 500, 501, 502], GREEDY, return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
                      return_text_in_logprobs=True)
        return (await h.result())[0]["meta_info"]

    meta = on_loop(engine, run())
    assert len(meta["output_token_logprobs"]) == 6 and len(meta["output_top_logprobs"]) == 6
    lp, tok, text = meta["output_token_logprobs"][0]
    assert lp <= 0 and isinstance(tok, int) and isinstance(text, str)
    assert [t for _, t, _ in meta["input_token_logprobs"]] == [1, 500, 501, 502]
    assert meta["input_token_logprobs"][0][0] is None  # the first token has no context
    # SGLang's input_top_logprobs: None for the first token, then each position's top 2 as triples with text.
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == 4
    assert all(len(row) == 2 and all(isinstance(t, int) and isinstance(x, str) for _, t, x in row)
               for row in meta["input_top_logprobs"][1:])


def test_every_way_a_consumer_leaves_aborts(engine: Engine) -> None:
    tm = engine.tm

    async def run() -> None:
        h = tm.submit(list(range(10, 30)), LONG)  # explicit abort
        await asyncio.sleep(0.2)
        h.abort()
        chunks = [c async for c in h.stream()]
        assert chunks[-1].finished == "abort"
        await idle(tm)

        h = tm.submit(list(range(10, 30)), LONG)  # the task awaiting the result is cancelled
        task = asyncio.create_task(h.result())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await idle(tm)

        h = tm.submit(list(range(10, 30)), LONG)  # the async generator is closed after one chunk
        agen = h.stream()
        await agen.__anext__()
        await agen.aclose()
        await idle(tm)

        h = tm.submit(list(range(10, 30)), LONG, timeout=1e-6)  # a per-chunk timeout
        with pytest.raises(TimeoutError, match="produced nothing"):
            await h.result()
        await idle(tm)

        h = tm.submit(list(range(10, 30)), LONG, deadline=0.3)  # a deadline with nobody reading
        await asyncio.sleep(0.6)
        await idle(tm)
        with pytest.raises(TimeoutError, match="deadline"):
            await h.result()

        tm.submit(list(range(10, 30)), LONG)  # dropped at once: garbage-collected
        gc.collect()
        await idle(tm)

    on_loop(engine, run())


def test_refusals_at_the_door(engine: Engine) -> None:
    tm = engine.tm

    async def run() -> None:
        cases = [(("",), "prompt"), (([],), "input_ids"), (([1, 4096],), "input_ids"), (([1, -1],), "input_ids"),
                 (([1, True],), "input_ids"), ((3,), "prompt"), (("x", {"n": 0}), "n"), (("x", []), "sampling_params")]
        for args, field in cases:
            with pytest.raises(InvalidRequest) as e:
                tm.submit(*args)
            assert e.value.param == field, args
        for kw, field in [({"rid": ""}, "rid"), ({"timeout": 0}, "timeout"), ({"deadline": float("nan")}, "deadline"),
                          ({"top_logprobs_num": 5000}, "top_logprobs_num"), ({"return_logprob": 1}, "return_logprob"),
                          ({"logprob_start_len": -2}, "logprob_start_len")]:
            with pytest.raises(InvalidRequest) as e:
                tm.submit("x", GREEDY, **kw)
            assert e.value.param == field, kw
        h = tm.submit("x", LONG, rid="dup")
        with pytest.raises(InvalidRequest, match="in use") as e:
            tm.submit("x", GREEDY, rid="dup")
        assert e.value.param == "rid"
        h.abort()
        await h.result()
        assert (await tm.get_metrics())["pending_requests"] == 0

    on_loop(engine, run())


def test_overload_flush_and_model_info(engine: Engine) -> None:
    tm = engine.tm

    async def run() -> None:
        limit = tm.args.max_queued_requests
        tm.args.max_queued_requests = 2
        try:
            handles = [tm.submit(list(range(10, 20)), LONG) for _ in range(2)]
            with pytest.raises(EngineOverloaded):
                tm.submit("x", GREEDY)
            assert not await tm.flush_cache()  # requests are running: the cache stays
        finally:
            tm.args.max_queued_requests = limit
        for h in handles:
            h.abort()
            await h.result()
        await idle(tm)
        assert await tm.flush_cache()
        m = await tm.get_metrics()
        assert m["kv_pool_bytes"] == 0 and m["state_pool_bytes"] == 0  # nothing left in the tree

    on_loop(engine, run())
    info = engine.model_info()
    assert info["vocab_size"] == 4096 and info["context_length"] > 0 and info["page_size"] == 1


def test_shutdown_fails_pending_requests() -> None:
    eng = Engine(mem_bytes=4 << 20)
    it = eng.stream(list(range(10, 30)), LONG)
    next(it)
    threading.Timer(0.3, eng.shutdown).start()
    with pytest.raises(EngineError, match="shut down"):
        for _ in it:
            pass
    with pytest.raises(EngineError, match="shut down"):
        eng.submit("x", GREEDY)
