"""One pool size for every process. Each worker rank sizes its pool (`--mem-fraction`: after loading its weights,
the smallest reading over its TP group) and reports the bytes it allocated in its `WorkerReady`; the scheduler
builds its pool metadata for that size and refuses to start, naming every rank's size, when its ranks disagree
(run against a real scheduler process, the test playing the supervisor and the two ranks); the tokenizer side
bounds a request by the same size. With `--mem-fraction` on CPU, the scheduler's pool is the worker's buffer."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator

import pytest
import zmq

from radixk3.config import TINY_PRESET, preset
from radixk3.model import build_model
from runtime.local_engine import LocalEngine
from runtime.messages import Shutdown, WorkerReady, decode, encode
from runtime.pool_layout import pool_layout
from runtime.scheduler_main import agreed_pool_bytes, scheduler_main
from runtime.server_args import ServerArgs
from runtime.tokenizer.engine import Engine
from runtime.topology import Topology
from tests.greedy import greedy_reference

POOL = 8 << 20
WAIT_MS = 60_000  # a spawned scheduler imports the runtime first


class _Supervisor:
    """A scheduler process for a --tp 2 replica, with the sockets its supervisor and its ranks would hold."""

    def __init__(self, ipc_dir: str) -> None:
        self.args = ServerArgs(tp_size=2, mem_bytes=POOL)
        self.topo = Topology.for_args(self.args, ipc_dir)
        self.ctx = zmq.Context()
        self.ready = self._socket(zmq.PULL, "ready", bind=True)
        self.out = self._socket(zmq.PULL, "sched_out", bind=True)
        self.proc = mp.get_context("spawn").Process(target=scheduler_main, args=(self.args, self.topo, 0), daemon=True)
        self.proc.start()
        self.ranks = self._socket(zmq.PUSH, "worker_out_0", bind=False)  # both ranks' results socket
        self.control = self._socket(zmq.PUSH, "sched_in_0", bind=False)

    def _socket(self, kind: int, name: str, *, bind: bool) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        (s.bind if bind else s.connect)(self.topo.addr(name))
        return s

    def relayed(self) -> WorkerReady:
        assert self.ready.poll(WAIT_MS), "the scheduler said nothing"
        msg = decode(self.ready.recv_multipart())
        assert isinstance(msg, WorkerReady)
        return msg

    def close(self) -> None:
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)
        self.ctx.destroy(linger=0)


@pytest.fixture
def supervisor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Supervisor]:
    s = _Supervisor(str(tmp_path_factory.mktemp("ipc")))
    try:
        yield s
    finally:
        s.close()


def test_scheduler_refuses_ranks_with_different_pool_sizes(supervisor: _Supervisor) -> None:
    supervisor.ranks.send_multipart(encode(WorkerReady(0, pool_bytes=POOL)))
    supervisor.ranks.send_multipart(encode(WorkerReady(1, pool_bytes=POOL - 4096)))
    msg = supervisor.relayed()  # not the ranks' readiness: the scheduler's refusal
    assert msg.error is not None and "different sizes" in msg.error
    assert f"rank 0: {POOL} bytes" in msg.error and f"rank 1: {POOL - 4096} bytes" in msg.error
    supervisor.proc.join(timeout=30)
    assert not supervisor.proc.is_alive()


def test_scheduler_relays_the_agreed_size(supervisor: _Supervisor) -> None:
    for rank in (1, 0):
        supervisor.ranks.send_multipart(encode(WorkerReady(rank, pool_bytes=POOL)))
    got = [supervisor.relayed() for _ in range(2)]
    assert sorted(r.rank for r in got) == [0, 1] and all(r.error is None and r.pool_bytes == POOL for r in got)
    supervisor.control.send_multipart(encode(Shutdown()))
    supervisor.proc.join(timeout=30)
    assert supervisor.proc.exitcode == 0


def test_agreed_pool_bytes() -> None:
    assert agreed_pool_bytes([WorkerReady(1, pool_bytes=POOL), WorkerReady(0, pool_bytes=POOL)], 0) == POOL
    with pytest.raises(ValueError, match=r"replica 3 .*rank 0: 1024 bytes, rank 1: 2048 bytes"):
        agreed_pool_bytes([WorkerReady(1, pool_bytes=2048), WorkerReady(0, pool_bytes=1024)], 3)
    with pytest.raises(ValueError, match="rank 0: None bytes"):
        agreed_pool_bytes([WorkerReady(0)], 0)


FRACTION = 0.002  # of the machine's available memory: tens of MB


def test_local_engine_pool_is_the_worker_buffer_with_mem_fraction() -> None:
    eng = LocalEngine(ServerArgs(mem_fraction=FRACTION))
    assert eng.scheduler.pool.geometry == eng.worker.buffer.geometry
    assert eng.scheduler.metrics_now().pool_bytes == eng.worker.buffer.data.numel() == eng.worker.pool_bytes > 0


def test_engine_with_mem_fraction_uses_the_workers_pool_size() -> None:
    """--tp 2: both ranks read their free memory after loading and agree on the smaller; the scheduler's pool
    and the tokenizer's per-request bound are the size they allocated."""
    with Engine(mem_fraction=FRACTION, tp_size=2) as engine:
        m = engine.get_metrics()
        assert m["pool_bytes"] == engine.procs.pool_bytes > 0  # the scheduler's pool == the ranks' buffers
        g = pool_layout(engine.procs.config, engine.args).geometry(m["pool_bytes"])
        room = g.state_base + (g.num_state_slots - 2) * g.state_block_bytes  # two states of its own, the rest KV
        assert engine.model_info()["context_length"] == min(g.num_pages, room // g.page_bytes) * g.page_size
        prompt = list(range(40, 70))
        out = engine.generate(prompt, {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        model = build_model(preset(TINY_PRESET), seed=engine.args.seed)
        assert out["output_ids"] == greedy_reference(model, prompt, 4)
