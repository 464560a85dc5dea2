"""/pause_generation and /continue_generation, as SGLang serves them (RL frameworks pause around weight updates):
while paused no step runs and new requests queue; `in_place` keeps the running requests' memory, `retract` frees
it (they are recomputed after), `abort` aborts every request in flight. Whatever the mode, a request that runs on
after the pause gets exactly the tokens it gets alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from tests.runtime.http_server_proc import Server

PROMPT = "Natalia sold clips to 48 of her friends in April"
NEW_TOKENS = 12


def generate(server: Server, max_new_tokens: int = NEW_TOKENS) -> dict[str, Any]:
    with server.client() as c:
        r = c.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": max_new_tokens,
                                                                          "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        return r.json()


def wait_for(server: Server, what: str, value: float, timeout: float = 30.0) -> None:
    """Until the metric `what` reads `value` (a bound on a hang, not on speed)."""
    end = time.monotonic() + timeout
    while (now := server.metrics()[what]) != value:
        assert time.monotonic() < end, f"{what} is {now}, not {value}"
        time.sleep(0.02)


class Streamer(threading.Thread):
    """A streamed /generate in the background: `first` is set at its first token; `result` is its last event,
    with `output_ids` every event's (each event carries the new ones)."""

    def __init__(self, server: Server, max_new_tokens: int = NEW_TOKENS) -> None:
        super().__init__(daemon=True)
        self.server, self.max_new_tokens = server, max_new_tokens
        self.first = threading.Event()
        self.result: dict[str, Any] = {}
        self.output_ids: list[int] = []

    def run(self) -> None:
        body = {"text": PROMPT, "stream": True,
                "sampling_params": {"max_new_tokens": self.max_new_tokens, "temperature": 0, "ignore_eos": True}}
        with self.server.client() as c, c.stream("POST", "/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.result = orjson.loads(line[6:])
                    self.output_ids += self.result["output_ids"]
                    self.first.set()
        self.first.set()


def pause(server: Server, mode: str) -> None:
    with server.client() as c:
        r = c.post("/pause_generation", json={"mode": mode})
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text


@pytest.fixture
def server(default_server: Server) -> Iterator[Server]:
    default_server.wait_idle()
    try:
        yield default_server
    finally:  # never leave the shared server paused
        with default_server.client() as c:
            assert c.post("/continue_generation").status_code == 200


def test_in_place_holds_new_requests_until_continue(server: Server) -> None:
    alone = generate(server)
    pause(server, "in_place")
    s = Streamer(server)
    s.start()
    wait_for(server, "radixk3_num_queued_reqs", 1)
    assert not s.first.is_set()  # queued, and no step runs while paused
    with server.client() as c:
        assert c.post("/continue_generation").json()["status"] == "ok"
    s.join(60)
    assert s.output_ids == alone["output_ids"]


def test_retract_frees_the_running_request_and_recomputes_it_exactly(server: Server) -> None:
    alone = generate(server, 48)
    s = Streamer(server, 48)
    s.start()
    assert s.first.wait(60)
    pause(server, "retract")
    wait_for(server, "radixk3_num_running_reqs", 0)  # retracted: its memory given back ...
    wait_for(server, "radixk3_num_queued_reqs", 1)  # ... and queued again
    with server.client() as c:
        c.post("/continue_generation")
    s.join(60)
    assert s.output_ids == alone["output_ids"]
    assert s.result["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_ends_every_request_and_later_ones_wait(server: Server) -> None:
    alone = generate(server)
    running = Streamer(server, 2000)
    running.start()
    assert running.first.wait(60)
    pause(server, "abort")
    running.join(60)
    assert running.result["meta_info"]["finish_reason"]["type"] == "abort"
    later = Streamer(server)
    later.start()
    wait_for(server, "radixk3_num_queued_reqs", 1)
    with server.client() as c:
        c.post("/continue_generation")
    later.join(60)
    assert later.output_ids == alone["output_ids"]


def test_an_unknown_mode_is_a_400_naming_it(default_server: Server) -> None:
    with default_server.client() as c:
        r = c.post("/pause_generation", json={"mode": "sideways"})
    assert r.status_code == 400 and "mode" in r.text, r.text
    assert generate(default_server)["meta_info"]["finish_reason"]["type"] == "length"  # not paused
