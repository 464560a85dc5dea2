"""The multi-process Engine: startup, exact greedy output, streaming, bad input, and a worker that dies."""

from __future__ import annotations

import os
import signal
import time

import pytest

from radixk3.config import preset
from radixk3.model import build_model
from runtime.errors import InvalidRequest
from runtime.tokenizer.engine import Engine, EngineError
from tests.greedy import greedy_reference
from tests.processes import alive


@pytest.fixture(scope="module")
def engine(builtin_engine: Engine) -> Engine:
    return builtin_engine


def test_generate_matches_reference_and_reports_cache(engine: Engine) -> None:
    model = build_model(preset("k3-tiny"), seed=engine.args.seed)
    shared = list(range(100, 160))
    prompts = [shared + [7, 8, 9], shared + [11, 12]]
    params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    assert engine.flush_cache()  # the engine is shared: the hits counted below are this test's own
    first = engine.generate(prompts[0], params)
    assert first["output_ids"] == greedy_reference(model, prompts[0], 5)
    second = engine.generate(prompts[1], params)
    assert second["output_ids"] == greedy_reference(model, prompts[1], 5)
    # The first request left a checkpoint after its whole prompt+output; the shared 60 tokens branch there.
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == 0  # KV matched, but the branching point had no state yet
    third = engine.generate(shared + [13], params)
    assert third["meta_info"]["cached_tokens"] == len(shared)  # the branching-point checkpoint now hits
    assert third["output_ids"] == greedy_reference(model, shared + [13], 5)


def test_stream_and_bad_input(engine: Engine) -> None:
    chunks = list(engine.stream("Hello", {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}))
    assert sum(len(c.token_ids) for c in chunks) == 3 and chunks[-1].finished == "length"
    with pytest.raises(InvalidRequest, match="temperature"):
        engine.generate("x", {"temperature": -1})
    with pytest.raises(InvalidRequest, match="empty") as empty:
        engine.stream([], {"max_new_tokens": 2})
    assert empty.value.param == "input_ids"
    with pytest.raises(InvalidRequest, match="exceed") as huge:  # refused at the door, before it is queued
        engine.generate("x", {"max_new_tokens": 10**7})
    assert huge.value.param == "max_new_tokens"


def test_worker_death_fails_pending_requests_and_shuts_down() -> None:
    eng = Engine(mem_bytes=8 << 20)
    try:
        worker = eng.procs.procs[0]
        chunks = eng.stream(list(range(50)), {"max_new_tokens": 5000, "ignore_eos": True}, timeout=30)
        time.sleep(0.5)
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(EngineError) as failed:
            for _ in chunks:
                pass
        assert "worker" in str(failed.value) and "exited" in str(failed.value)
        eng.procs.watcher.join(timeout=30)  # it shuts the processes down after failing the requests
        assert not any(p.is_alive() for p in eng.procs.procs)
        assert not os.path.exists(eng.procs.ipc_dir)
        with pytest.raises(EngineError):
            eng.generate("again", {"max_new_tokens": 1})
    finally:
        eng.shutdown()


def test_n_samples_and_metrics(engine: Engine) -> None:
    outs = engine.generate("Weng earns", {"max_new_tokens": 4, "temperature": 1.0, "seed": 3, "n": 3,
                                          "ignore_eos": True})
    assert len(outs) == 3 and all(len(o["output_ids"]) == 4 for o in outs)
    again = engine.generate("Weng earns", {"max_new_tokens": 4, "temperature": 1.0, "seed": 3, "n": 3,
                                           "ignore_eos": True})
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in again]  # seeded: reproducible
    m = engine.get_metrics()
    assert m["steps"] > 0 and m["prefill_tokens_computed"] > 0 and m["running"] == 0


def test_startup_failure_names_the_problem(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(EngineError, match="config.json not found"):
        Engine(model=str(tmp_path / "missing"))


# The script takes Ctrl-C as one started in a terminal does: a parent that ignores SIGINT (a shell's background job,
# as `make test &` is) passes that on, and Python then installs no KeyboardInterrupt handler.
CTRL_C_SCRIPT = """
import os, signal, sys, time
from runtime.tokenizer.engine import Engine
if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    eng = Engine(mem_bytes=4 << 20)
    print(" ".join(str(p.pid) for p in eng.procs.procs), eng.procs.ipc_dir, flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_ctrl_c_or_kill_leaves_no_orphans(tmp_path, sig: int) -> None:  # noqa: ANN001
    import subprocess
    import sys

    script = tmp_path / "serve.py"
    script.write_text(CTRL_C_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        line = proc.stdout.readline().split()  # type: ignore[union-attr]
        pids, ipc_dir = [int(x) for x in line[:-1]], line[-1]
        proc.send_signal(sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.2)
        assert not any(alive(p) for p in pids), "orphan processes"
        assert not os.path.exists(ipc_dir)
    finally:
        proc.kill()


def test_async_stream(engine: Engine) -> None:
    import asyncio

    async def collect() -> list[int]:
        out: list[int] = []
        async for chunk in engine.async_stream("Hello", {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}):
            out.extend(chunk.token_ids)
        return out

    sync = engine.generate("Hello", {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})["output_ids"]
    assert asyncio.run(collect()) == sync


def test_stop_string_trims_text(engine: Engine) -> None:
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    full = engine.generate("Natalia sold", params)
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    cut = engine.generate("Natalia sold", params | {"stop": [stop]})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == text[: text.index(stop)]
