"""P/D disaggregation in one process: a prefill and a decode LocalEngine over the fake backend (and over NIXL on
loopback), greedy outputs equal the aggregated engine's token for token, the KDA state and the MLA pages on decode
equal prefill's byte for byte after the transfer, and both pools return to their baseline."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import time

import pytest

from radixk3.config import preset
from radixk3.model import build_model
from runtime.local_engine import LocalEngine
from runtime.messages import Bootstrap, TokenOut
from runtime.server_args import ServerArgs
from tests.runtime.http_server_proc import free_port

MAX_NEW = 5
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
BASE = ServerArgs(disable_compile=True, page_size=4, max_running_requests=8, chunked_prefill_size=16)


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return build_model(preset("k3-tiny"), seed=11)


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:  # noqa: ANN001
    g = random.Random(3)
    v = model.config.vocab_size
    shared = [g.randrange(v) for _ in range(9)]
    return [[g.randrange(v) for _ in range(n)] for n in (3, 21, 40)] + [shared + [g.randrange(v)] for _ in range(2)]


@pytest.fixture(scope="module")
def want(model, prompts) -> list[list[int]]:  # noqa: ANN001
    """The aggregated engine's greedy outputs."""
    return LocalEngine(BASE, model).generate(prompts, GREEDY)


def _pair(model, backend: str, **kw: object) -> tuple[LocalEngine, LocalEngine, int]:  # noqa: ANN001
    port = free_port()
    common = dict(disaggregation_transfer_backend=backend, **kw)
    pre = LocalEngine(dataclasses.replace(BASE, disaggregation_mode="prefill", disaggregation_bootstrap_port=port,
                                          **common), model, check=True)
    dec = LocalEngine(dataclasses.replace(BASE, disaggregation_mode="decode", **common), model, check=True)
    return pre, dec, port


def _step_both(pre: LocalEngine, dec: LocalEngine) -> dict[tuple[str, str], list[TokenOut]]:
    """Step both engines in turn until neither has work; their outputs by (side, request id): the two engines
    number their requests alike."""
    outs: dict[tuple[str, str], list[TokenOut]] = {}
    while pre.loop.busy or dec.loop.busy:
        for side, engine in (("prefill", pre), ("decode", dec)):
            for o in engine.loop.step() if engine.loop.busy else []:
                outs.setdefault((side, o.rid), []).append(o)
    return outs


def _run_both(pre: LocalEngine, dec: LocalEngine) -> dict[str, list[int]]:
    """Step both engines until neither has work; the decode side's tokens by request id."""
    outs: dict[str, list[int]] = {}
    for (side, rid), chunks in _step_both(pre, dec).items():
        if side == "decode":
            for o in chunks:
                assert o.error is None, o.error
                outs.setdefault(rid, []).extend(o.token_ids)
    return outs


def _close(*engines: LocalEngine) -> None:
    for e in engines:
        side = e.scheduler.pd_prefill or e.scheduler.pd_decode
        if side is not None:
            side.close()


def _state_digest(engine: LocalEngine, ids: list[int]) -> tuple[str, str]:
    """Digests of the KDA state block and the MLA pages the radix tree holds for exactly `ids` (both sides
    donate the request's state after its prompt to the tree)."""
    s = engine.scheduler
    m = s.cache.match_prefix([*ids, 0])  # a match leaves the last token to compute: one more to match all of ids
    assert m.prefix_len == len(ids) and m.state is not None
    buf = engine.worker.buffer
    state = buf.state_bytes(s.pool.state_slot(m.state)).numpy().tobytes()
    pages = b"".join(buf.page_bytes(s.pool.page_index(p)).numpy().tobytes() for p in m.pages)
    return hashlib.sha256(state).hexdigest(), hashlib.sha256(pages).hexdigest()


@pytest.mark.parametrize("backend", ["fake", "nixl"])
def test_pd_equals_aggregated(model, prompts, want, backend: str) -> None:  # noqa: ANN001
    if backend == "nixl":
        pytest.importorskip("nixl")
    pre, dec, port = _pair(model, backend)
    try:
        rids = []
        for i, p in enumerate(prompts):
            boot = Bootstrap("127.0.0.1", port, 7000 + i)
            pre.submit(p, GREEDY, bootstrap=boot)
            rids.append(dec.submit(p, GREEDY, bootstrap=boot))
        outs = _run_both(pre, dec)
        assert [outs[r] for r in rids] == want
        for e in (pre, dec):  # nothing left held: every request's memory went back to the pool or the tree
            s = e.scheduler
            s.check_integrity()
            assert not s.running and not s.has_work
            assert s.flush_cache() and s.pool.states_used == 0 and s.pool.pages_used == 0
    finally:
        _close(pre, dec)


def test_state_bytes_equal_after_transfer(model, prompts) -> None:  # noqa: ANN001
    """One token on decode: it ends on the first token, so each side's tree keeps the very state and pages the
    prefill computed and the transfer wrote."""
    pre, dec, port = _pair(model, "fake")
    try:
        one = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
        p = prompts[2]  # 40 tokens: page-aligned, so both sides donate the state after the whole prompt
        boot = Bootstrap("127.0.0.1", port, 99)
        pre.submit(p, one, bootstrap=boot)
        dec.submit(p, one, bootstrap=boot)
        _run_both(pre, dec)
        assert _state_digest(dec, p) == _state_digest(pre, p)
    finally:
        _close(pre, dec)


def _finish(engine: LocalEngine) -> dict[str, list]:
    """Step one engine until it has no work; its TokenOuts by request id."""
    outs: dict[str, list] = {}
    while engine.loop.busy:
        for o in engine.loop.step():
            outs.setdefault(o.rid, []).append(o)
    return outs


def _baseline(engine: LocalEngine) -> None:
    s = engine.scheduler
    s.check_integrity()
    assert s.flush_cache() and s.pool.states_used == 0 and s.pool.pages_used == 0


def test_room_without_partner_times_out(model) -> None:  # noqa: ANN001
    """A decode request whose prefill never comes, and a prefill request whose decode never reserves, fail with an
    error naming the timeout; both pools are back to empty."""
    pre, dec, port = _pair(model, "fake", disaggregation_timeout=0.3)
    try:
        dec_rid = dec.submit([1, 2, 3], GREEDY, bootstrap=Bootstrap("127.0.0.1", port, 1))
        pre_rid = pre.submit([4, 5, 6], GREEDY, bootstrap=Bootstrap("127.0.0.1", port, 2))
        for engine, rid, side in ((dec, dec_rid, "prefill"), (pre, pre_rid, "decode")):
            last = _finish(engine)[rid][-1]
            assert last.finished == "error" and "--disaggregation-timeout" in last.error and side in last.error
            _baseline(engine)
    finally:
        _close(pre, dec)


def test_room_timed_out_with_a_write_queued_keeps_its_memory_until_prefill_answers(model) -> None:  # noqa: ANN001
    """Decode times a room out while prefill has its last write queued (prefill has not heard yet): the client hears
    at once, but the memory that write targets stays held (pinned, not reusable) until prefill answers that
    nothing more will land; then both pools are back to empty and the request ended exactly once."""
    pre, dec, port = _pair(model, "fake", disaggregation_timeout=2.0)  # ample for the steps before the wait
    try:
        boot = Bootstrap("127.0.0.1", port, 7)
        prompt = list(range(10, 30))
        pre.submit(prompt, GREEDY, bootstrap=boot)
        dec_rid = dec.submit(prompt, GREEDY, bootstrap=boot)
        side = dec.scheduler.pd_decode
        while not side.rooms or not all(r.sent for r in side.rooms.values()):
            dec.loop.step()
        while not pre.scheduler.pd_prefill._sends:  # prefill computed the prompt: its write goes with the next plan
            assert pre.loop.busy, "prefill ended the request without queueing its write"
            pre.loop.step()
        (room,) = side.rooms.values()
        time.sleep(max(0.0, room.deadline - time.monotonic()) + 0.05)
        outs = dec.loop.step()
        assert [o.finished for o in outs if o.rid == dec_rid] == ["error"]
        assert "--disaggregation-timeout" in outs[-1].error
        assert dec.scheduler.pool.states_used == 1 and dec.scheduler.pool.pages_used == 5  # still the write's target
        ends = [o for (side, _), chunks in _step_both(pre, dec).items() if side == "decode" for o in chunks
                if o.finished]
        assert ends == [], ends
        for engine in (pre, dec):
            _baseline(engine)
    finally:
        _close(pre, dec)


def test_different_prompts_on_the_two_sides_fail_that_request_alone(model, prompts, want) -> None:  # noqa: ANN001
    """Decode reserved pages for another prompt than prefill got under the same room (a client that bypassed the
    router): that request fails on both sides by name, and both servers go on serving."""
    pre, dec, port = _pair(model, "fake")
    try:
        boot = Bootstrap("127.0.0.1", port, 11)
        pre_rid = pre.submit(list(range(10, 30)), GREEDY, bootstrap=boot)
        dec_rid = dec.submit(list(range(10, 50)), GREEDY, bootstrap=boot)
        outs = _step_both(pre, dec)
        for key in (("prefill", pre_rid), ("decode", dec_rid)):
            last = outs[key][-1]
            assert last.finished == "error" and "different prompts" in last.error, (key, last.error)
        for engine in (pre, dec):
            _baseline(engine)
        boot = Bootstrap("127.0.0.1", port, 12)
        pre.submit(prompts[1], GREEDY, bootstrap=boot)
        rid = dec.submit(prompts[1], GREEDY, bootstrap=boot)
        assert _run_both(pre, dec)[rid] == want[1]
    finally:
        _close(pre, dec)


def test_abort_on_decode_reaches_prefill(model) -> None:  # noqa: ANN001
    pre, dec, port = _pair(model, "fake")
    try:
        boot = Bootstrap("127.0.0.1", port, 5)
        pre_rid = pre.submit(list(range(10, 40)), GREEDY, bootstrap=boot)
        dec_rid = dec.submit(list(range(10, 40)), GREEDY, bootstrap=boot)
        while not dec.scheduler.pd_decode.rooms or not all(r.sent for r in dec.scheduler.pd_decode.rooms.values()):
            dec.loop.step()  # decode reserved and told prefill where
        dec.scheduler.abort(dec_rid)
        outs = _step_both(pre, dec)
        assert outs["decode", dec_rid][-1].finished == "abort"
        assert outs["prefill", pre_rid][-1].finished == "abort", outs["prefill", pre_rid][-1]
        for engine in (pre, dec):
            _baseline(engine)
    finally:
        _close(pre, dec)


def test_page_size_mismatch_is_refused_by_name(model) -> None:  # noqa: ANN001
    port = free_port()
    pre = LocalEngine(dataclasses.replace(BASE, disaggregation_mode="prefill", disaggregation_bootstrap_port=port,
                                          disaggregation_transfer_backend="fake"), model)
    dec = LocalEngine(dataclasses.replace(BASE, page_size=1, disaggregation_mode="decode",
                                          disaggregation_transfer_backend="fake"), model)
    try:
        rid = dec.submit([1, 2, 3], GREEDY, bootstrap=Bootstrap("127.0.0.1", port, 1))
        last = _finish(dec)[rid][-1]
        assert last.finished == "error" and "--page-size 4" in last.error and "same page size" in last.error
        _baseline(dec)
    finally:
        _close(pre, dec)


def test_decode_side_radix_cache(model, prompts, want) -> None:  # noqa: ANN001
    """--disaggregation-decode-enable-radix-cache: the next turn of a conversation hits what decode donated to its
    tree at the end of the last turn (a page-aligned end holds a state), so decode reserves and receives only the
    pages past it (the state still moves); outputs stay equal to the aggregated engine's."""
    turn2 = [p + w + [7, 8, 9] for p, w in zip(prompts, want, strict=True)]
    want2 = LocalEngine(BASE, model).generate(turn2, GREEDY)
    port = free_port()
    common = dict(disaggregation_transfer_backend="fake")
    pre = LocalEngine(dataclasses.replace(BASE, disaggregation_mode="prefill", disaggregation_bootstrap_port=port,
                                          **common), model, check=True)
    dec = LocalEngine(dataclasses.replace(BASE, disaggregation_mode="decode",
                                          disaggregation_decode_enable_radix_cache=True, **common), model, check=True)
    try:
        for turn, (wave, expected) in enumerate([(prompts, want), (turn2, want2)]):
            rids = []
            for i, p in enumerate(wave):
                boot = Bootstrap("127.0.0.1", port, 100 * turn + i)
                pre.submit(p, GREEDY, bootstrap=boot)
                rids.append(dec.submit(p, GREEDY, bootstrap=boot))
            outs = _run_both(pre, dec)
            assert [outs[r] for r in rids] == expected, f"turn {turn}"
            cached = dec.scheduler.metrics_now().cached_tokens
            assert (cached > 0) == (turn == 1), cached  # the 40-token prompt's first turn ends page-aligned
        for e in (pre, dec):
            _baseline(e)
    finally:
        _close(pre, dec)


def test_long_prompt_goes_chunk_by_chunk(model) -> None:  # noqa: ANN001
    """A prompt of several chunks (--chunked-prefill-size 16): the pages each chunk completed go as it completes
    them, so prefill's workers write the room in more than one transfer; together they move exactly what the pool
    geometry says (every prompt page and one state block), and the output equals the aggregated engine's. (Over
    NIXL, test_pd_equals_aggregated's 40-token prompt goes in chunks too.)"""
    g = random.Random(8)
    prompt = [g.randrange(model.config.vocab_size) for _ in range(50)]
    want = LocalEngine(BASE, model).generate([prompt], GREEDY)
    pre, dec, port = _pair(model, "fake")
    try:
        boot = Bootstrap("127.0.0.1", port, 4242)
        pre.submit(prompt, GREEDY, bootstrap=boot)
        rid = dec.submit(prompt, GREEDY, bootstrap=boot)
        assert [_run_both(pre, dec)[rid]] == want
        m, geometry = pre.scheduler.metrics_now(), pre.scheduler.pool.geometry
        assert m.pd_transfers > 1
        assert m.pd_kv_bytes == -(-len(prompt) // BASE.page_size) * geometry.page_bytes
        assert m.pd_state_bytes == geometry.state_block_bytes
        assert 0 < m.pd_timed_bytes < m.pd_kv_bytes + m.pd_state_bytes + 16 and m.pd_timed_seconds > 0
        for e in (pre, dec):
            _baseline(e)
    finally:
        _close(pre, dec)


def test_room_arrives_only_with_all_its_transfers(model) -> None:  # noqa: ANN001
    """Decode's worker counts a room's notifications against the total its last transfer carries: the last one
    landing before a chunk's (NIXL orders no notifications across transfers) does not complete the room."""
    dec = LocalEngine(dataclasses.replace(BASE, disaggregation_mode="decode", disaggregation_transfer_backend="fake"),
                      model)
    try:
        worker = dec.worker
        worker._expect[77] = 0
        worker.transfer._inbox.append((77, 3))  # the last of three transfers
        assert worker._pd_arrivals() == []
        worker.transfer._inbox.append((77, None))
        assert worker._pd_arrivals() == []
        worker.transfer._inbox.append((77, None))
        assert [room for room, _, _ in worker._pd_arrivals()] == [77]
    finally:
        _close(dec)


def test_failed_chunk_write_frees_both_sides(model, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A prompt chunk's write fails mid-room: the request fails on decode with the transfer's error, prefill drops
    it, and both pools go back to their baseline."""
    pre, dec, port = _pair(model, "fake")

    def broken(chunk: object) -> object:
        raise ConnectionError("the link went down")

    monkeypatch.setattr(pre.worker.transfer, "post", broken)
    try:
        boot = Bootstrap("127.0.0.1", port, 31)
        pre_rid = pre.submit(list(range(100, 170)), GREEDY, bootstrap=boot)
        dec_rid = dec.submit(list(range(100, 170)), GREEDY, bootstrap=boot)
        outs = _step_both(pre, dec)
        last = outs["decode", dec_rid][-1]
        assert last.finished == "error" and "the link went down" in last.error
        assert outs["prefill", pre_rid][-1].finished == "abort"
        for engine in (pre, dec):
            _baseline(engine)
    finally:
        _close(pre, dec)


def test_a_malformed_control_message_is_dropped() -> None:
    """A stray message on a P/D control socket (not orjson, or not a known message) is dropped with a warning; the
    scheduler that drains it goes on."""
    from runtime.disagg.protocol import RoomFailed, encode_control
    from runtime.scheduler.disagg import _Control

    control = _Control("127.0.0.1")
    try:
        link = control.connect(control.address)
        for raw in (b"\x00not json", b'{"kind": "nothing"}', encode_control(RoomFailed("prefill", 3, "why"))):
            link.send(raw)
        got: list = []
        deadline = time.monotonic() + 10
        while not got:
            assert time.monotonic() < deadline, "the messages did not arrive"
            got = control.drain()
            time.sleep(0.01)
        assert got == [RoomFailed("prefill", 3, "why")]
    finally:
        control.close()

