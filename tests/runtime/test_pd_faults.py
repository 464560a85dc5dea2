"""P/D disaggregation's process faults, with real processes over NIXL (UCX over TCP on loopback): a prefill or a
decode server killed (SIGKILL) while a room is between the two. The survivor fails the room well before
--disaggregation-timeout (set long here, so that a fault noticed only by it fails the bounds below), its pool is
back to baseline, and it serves the next request with a live peer: a prefill server started at the dead one's
bootstrap address, a decode server that registers after the dead one."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from runtime.disagg.protocol import SendCommand
from runtime.local_engine import LocalEngine
from runtime.messages import Bootstrap
from runtime.server_args import ServerArgs
from tests.runtime.http_server_proc import Server, free_port, start_server
from tests.runtime.test_pd_local import _baseline, _close

pytest.importorskip("nixl")

TIMEOUT_S = 60.0  # --disaggregation-timeout on every side: the faults must be noticed long before it
NOTICE_S = 15.0  # how long a test waits for the survivor's outcome
PROMPT = list(range(200, 221))
GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
ARGS = ServerArgs(disable_compile=True, disaggregation_transfer_backend="nixl", disaggregation_timeout=TIMEOUT_S)
FLAGS = ("--disable-compile", "--disaggregation-timeout", str(TIMEOUT_S))


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Server, Server, int]]:
    """(a prefill server with its bootstrap port, a decode server), started together."""
    os.environ.setdefault("UCX_TLS", "tcp")  # the servers and this process's engines
    boot = free_port()
    flags = [["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot)],
             ["--disaggregation-mode", "decode"]]
    with ThreadPoolExecutor(2) as pool:
        pre, dec = pool.map(lambda f: start_server(*FLAGS, *f), flags)
    try:
        yield pre, dec, boot
    finally:
        pre.stop()
        dec.stop()


@pytest.fixture(scope="module")
def want() -> list[int]:
    """The aggregated engine's greedy output for PROMPT (the servers' model: the built-in one)."""
    return LocalEngine(ServerArgs(disable_compile=True)).generate([PROMPT], GREEDY)[0]


def _kill(server: Server) -> None:
    """SIGKILL the server's processes (the scheduler holds the bootstrap server and the control socket, the
    workers the transfer agents), children first."""
    children = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True,
                              check=False).stdout.split()
    for pid in [*map(int, children), server.proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    server.proc.wait(10)


def _post(server: Server, boot: Bootstrap) -> Future[httpx.Response]:
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "bootstrap_host": boot.host,
            "bootstrap_port": boot.port, "bootstrap_room": boot.room}
    pool = ThreadPoolExecutor(1)
    future = pool.submit(lambda: httpx.post(f"{server.url}/generate", json=body, timeout=NOTICE_S))
    pool.shutdown(wait=False)
    return future


def _until(what: str, done: object, step: object = None) -> None:
    """Wait (stepping `step` if given) until done() holds, at most NOTICE_S."""
    deadline = time.monotonic() + NOTICE_S
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {NOTICE_S:g} s: {what}"
        if step is not None:
            step()  # type: ignore[operator]
        else:
            time.sleep(0.05)


def _server_empty(server: Server) -> None:
    server.wait_idle(NOTICE_S)
    with server.client() as c:
        assert c.post("/flush_cache").status_code == 200
    m = server.metrics()
    assert m["radixk3_state_pool_used_bytes"] == 0 and m["radixk3_kv_pool_used_bytes"] == 0, m


def _engine_empty(engine: LocalEngine) -> None:
    assert not engine.scheduler.has_work
    _baseline(engine)


def _serve(prefill: LocalEngine, decode: Server, boot: Bootstrap) -> list[int]:
    """One request through an in-process prefill engine and a decode server: decode's output ids."""
    reply = _post(decode, boot)
    prefill.submit(PROMPT, GREEDY, bootstrap=boot)
    _until("the prefill engine sent the room", lambda: not prefill.loop.busy, prefill.loop.step)
    r = reply.result(NOTICE_S)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_prefill_killed_fails_the_decode_room(servers, want) -> None:  # noqa: ANN001
    """Decode holds a room (pages, state block, metadata slot) for a prefill server that dies: its client gets an
    error naming it, its memory is freed, and a prefill server restarted at the same bootstrap address serves the
    next request (decode looks it up again: the dead one's control address is not reused)."""
    pre, dec, port = servers
    reply = _post(dec, Bootstrap("127.0.0.1", port, 1))
    _until("decode reserved the room", lambda: dec.metrics()["radixk3_state_pool_used_bytes"] > 0)
    _kill(pre)
    r = reply.result(NOTICE_S)
    assert r.status_code != 200 and "went away" in r.text, r.text
    _server_empty(dec)
    restarted = LocalEngine(dataclasses.replace(ARGS, disaggregation_mode="prefill",
                                                disaggregation_bootstrap_port=port))
    try:
        assert _serve(restarted, dec, Bootstrap("127.0.0.1", port, 2)) == want
        _server_empty(dec)
        _engine_empty(restarted)
    finally:
        _close(restarted)


def test_decode_killed_fails_the_prefill_room(servers, want) -> None:  # noqa: ANN001
    """A decode server dies after reserving a room, while the prefill engine computes its prompt: the prefill
    engine lets the room go (no write left hanging), its memory is freed, a NIXL write to the dead agent fails
    at once, its workers forget that agent, and a decode engine that registers afterwards is served."""
    dec = servers[1]
    port = free_port()
    pre = LocalEngine(dataclasses.replace(ARGS, disaggregation_mode="prefill", disaggregation_bootstrap_port=port))
    fresh = None
    try:
        boot = Bootstrap("127.0.0.1", port, 3)
        reply = _post(dec, boot)
        side = pre.scheduler.pd_prefill
        _until("prefill got decode's reservation", lambda: boot.room in side.reserves and not side.plan_due,
               pre.loop.step)  # and its workers added decode's agent
        [dead_peer] = side.peers
        rid = pre.submit(PROMPT, GREEDY, bootstrap=boot)
        first: list[object] = []
        _until("prefill sampled the first token",
               lambda: any(o.rid == rid and o.finished for o in first), lambda: first.extend(pre.loop.step()))
        _kill(dec)
        write = SendCommand(dead_peer, 99, [], [], 0, 0, 0, 64, 0, 1, 0.0)
        with pytest.raises(Exception, match="DISCONNECT"):  # NIXL_ERR_REMOTE_DISCONNECT, never a hang
            pre.worker.transfer.send(write)
        with pytest.raises(httpx.TransportError):
            reply.result(NOTICE_S)
        _until("the prefill engine let the room go and forgot the dead decode server",
               lambda: not pre.loop.busy and dead_peer not in side.peers, pre.loop.step)
        _engine_empty(pre)
        with pytest.raises(KeyError, match="forgotten"):  # its workers dropped the dead agent
            pre.worker.transfer.send(write)
        fresh = LocalEngine(dataclasses.replace(ARGS, disaggregation_mode="decode"))
        boot = Bootstrap("127.0.0.1", port, 4)
        pre.submit(PROMPT, GREEDY, bootstrap=boot)
        rid = fresh.submit(PROMPT, GREEDY, bootstrap=boot)
        outs: list[int] = []

        def step_both() -> None:
            for engine in (pre, fresh):
                for o in engine.loop.step() if engine.loop.busy else []:
                    assert o.error is None, o.error
                    outs.extend(o.token_ids if o.rid == rid else [])

        _until("the new decode engine was served", lambda: not (pre.loop.busy or fresh.loop.busy), step_both)
        assert outs == want
        _engine_empty(pre)
        _engine_empty(fresh)
    finally:
        _close(pre)
        if fresh is not None:
            _close(fresh)


def test_silent_bootstrap_server_does_not_hold_up_the_others(want) -> None:  # noqa: ANN001
    """A request whose prefill host does not answer its bootstrap lookup (a listening socket that never accepts)
    waits for it in a thread: the decode engine serves a request for a live prefill server meanwhile, and the
    silent one's request fails by name once its lookup does."""
    port = free_port()
    fake = dataclasses.replace(ARGS, disaggregation_transfer_backend="fake")
    pre = LocalEngine(dataclasses.replace(fake, disaggregation_mode="prefill", disaggregation_bootstrap_port=port))
    dec = LocalEngine(dataclasses.replace(fake, disaggregation_mode="decode"))
    silent = socket.socket()
    try:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        stuck = dec.submit(PROMPT, GREEDY, bootstrap=Bootstrap("127.0.0.1", silent.getsockname()[1], 5))
        boot = Bootstrap("127.0.0.1", port, 6)
        pre.submit(PROMPT, GREEDY, bootstrap=boot)
        live = dec.submit(PROMPT, GREEDY, bootstrap=boot)
        outs: dict[str, list] = {}

        def step_both() -> None:
            for engine in (pre, dec):
                for o in engine.loop.step() if engine.loop.busy else []:
                    if engine is dec:  # (each engine numbers its own request ids)
                        outs.setdefault(o.rid, []).append(o)

        _until("the live prefill's request was served", lambda: live in outs and outs[live][-1].finished, step_both)
        assert [t for o in outs[live] for t in o.token_ids] == want and outs[live][-1].error is None
        assert stuck not in outs, "the request for the silent prefill host ended before the other was served"
        silent.close()  # its lookup fails now (connection reset), not at the lookup's timeout
        _until("the silent host's request failed", lambda: not dec.loop.busy, step_both)
        last = outs[stuck][-1]
        assert last.finished == "error" and "did not answer" in last.error, last.error
        _engine_empty(pre)
        _engine_empty(dec)
    finally:
        silent.close()
        _close(pre)
        _close(dec)


def test_abort_on_prefill_reaches_decode() -> None:
    """The prefill half of a request aborted while it runs there (its client left): decode, which holds the room's
    memory, hears that nothing will come, fails its request by name and frees the room; both pools are back to
    baseline. (A failed transfer takes the same way to decode: `PrefillSide.step_done` -> `tell_failed`.)"""
    port = free_port()
    fake = dataclasses.replace(ARGS, disaggregation_transfer_backend="fake", chunked_prefill_size=8)
    pre = LocalEngine(dataclasses.replace(fake, disaggregation_mode="prefill", disaggregation_bootstrap_port=port))
    dec = LocalEngine(dataclasses.replace(fake, disaggregation_mode="decode"))
    try:
        boot = Bootstrap("127.0.0.1", port, 7)
        pre_rid = pre.submit(PROMPT, GREEDY, bootstrap=boot)
        dec_rid = dec.submit(PROMPT, GREEDY, bootstrap=boot)
        outs: dict[tuple[int, str], list] = {}

        def step_both() -> None:
            for i, engine in enumerate((pre, dec)):
                for o in engine.loop.step() if engine.loop.busy else []:
                    outs.setdefault((i, o.rid), []).append(o)

        _until("prefill started the prompt", lambda: any(r.num_computed for r in pre.scheduler.running), step_both)
        pre.scheduler.abort(pre_rid)  # a chunk of the 21-token prompt is computed, not all of it
        _until("both engines are idle", lambda: not (pre.loop.busy or dec.loop.busy), step_both)
        assert outs[(0, pre_rid)][-1].finished == "abort"
        last = outs[(1, dec_rid)][-1]
        assert last.finished == "error" and "prefill" in last.error and "aborted" in last.error, last.error
        _engine_empty(pre)
        _engine_empty(dec)
    finally:
        _close(pre)
        _close(dec)
