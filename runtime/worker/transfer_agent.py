"""A worker rank's transfer agent (P/D disaggregation): it registers the rank's pool buffer (one byte buffer, so
once) and a few metadata slots, and moves a room's bytes straight from this pool into a peer's registered memory.

`nixl`: NIXL over UCX (TCP on loopback or across machines here; RDMA / NVLink on GPUs). `fake`: the same
interface in one process (two LocalEngines in a unit test): byte copies between the registered buffers.
A prefill rank writes the pages each prompt chunk completed as it completes them (`post`: one transfer started
after the step's copies and waited for after its forward), then the rest of the pages, the state block and the
metadata slot in the room's last transfer (`send`: waited for before the step goes on). Each transfer notifies
the room; the decode rank polls its notifications and counts them against the last one's total.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time
import uuid
from typing import Protocol, TypeVar

import torch

from runtime.disagg.protocol import (
    META_SLOT_BYTES,
    ChunkSend,
    RankAgent,
    SendCommand,
    agent_bytes,
    agent_text,
    parse_notif,
    room_notif,
)

SEND_TIMEOUT_S = 30.0
PROGRESS_INTERVAL_S = 0.0005  # a decode rank's NIXL progress: well under a step, and no core spent spinning
_META_COLS = META_SLOT_BYTES // 8  # float64: the token id (exact below 2**53) and its logprob
T = TypeVar("T")


class TransferAgent(Protocol):
    meta: torch.Tensor  # [slots, 2] float64: the rooms' first token and its logprob, as the prefill side wrote them

    def describe(self) -> RankAgent: ...
    def add_peer(self, peer: str, agent: RankAgent) -> None: ...
    def remove_peer(self, peer: str) -> None: ...
    def send(self, cmd: SendCommand) -> None: ...
    def post(self, chunk: ChunkSend) -> object: ...
    def wait(self, handle: object) -> None: ...
    def poll(self) -> list[tuple[int, int | None]]: ...


def _runs(src: list[int], dst: list[int], size: int) -> list[tuple[int, int, int]]:
    """(src, dst, nbytes) with the blocks that follow each other on both sides merged into one run."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + size)
        else:
            out.append((s, d, size))
    return out


def _known(peers: dict[str, T], peer: str) -> T:
    if peer not in peers:
        raise KeyError(f"no transfer peer {peer}: it never said hello, or it died and was forgotten")
    return peers[peer]


def command_runs(cmd: SendCommand) -> list[tuple[int, int, int]]:
    """A room's last writes as (source pool offset, destination pool offset, bytes): its pages, then its state."""
    return [*_runs(cmd.src_pages, cmd.dst_pages, cmd.page_bytes), (cmd.src_state, cmd.dst_state, cmd.state_bytes)]


def chunk_runs(chunk: ChunkSend) -> list[tuple[int, int, int]]:
    return _runs(chunk.src_pages, chunk.dst_pages, chunk.page_bytes)


class NixlAgent:
    def __init__(self, pool: torch.Tensor, meta_slots: int) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.pool = pool
        self.meta = torch.zeros(meta_slots, _META_COLS, dtype=torch.float64, device=pool.device)
        self._staging = torch.zeros(1, _META_COLS, dtype=torch.float64, device=pool.device)
        self.name = f"radixk3-{uuid.uuid4().hex[:12]}"
        # NIXL's progress thread polls without pause: on a CPU server it takes a core from the forward (each
        # server of a P/D pair on a 2-core machine lost one). There the progress is made by a prefill rank's own
        # waits and, on a decode rank (which must progress to take in TCP writes), by `_progress`.
        self.agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=pool.is_cuda, backends=["UCX"]))
        self._mem = "VRAM" if pool.is_cuda else "DRAM"
        self._dev = (pool.device.index or 0) if pool.is_cuda else 0
        for t in (pool, self.meta, self._staging):
            self.agent.register_memory(self.agent.get_reg_descs(t, self._mem))
        self._peers: dict[str, tuple[str, RankAgent]] = {}
        self._metadata = self.agent.get_agent_metadata()
        self._notifs: list[tuple[int, int | None]] = []
        self._lock = threading.Lock()
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()

    def describe(self) -> RankAgent:
        return RankAgent(agent_text(self._metadata), self.pool.data_ptr(), self.meta.data_ptr(), self._dev)

    def add_peer(self, peer: str, agent: RankAgent) -> None:
        if peer not in self._peers:
            self._peers[peer] = (self.agent.add_remote_agent(agent_bytes(agent.agent)), agent)

    def remove_peer(self, peer: str) -> None:
        """A dead peer: its agent's metadata (and UCX endpoints) go."""
        if (known := self._peers.pop(peer, None)) is not None:
            self.agent.remove_remote_agent(known[0])

    def send(self, cmd: SendCommand) -> None:
        _, peer = _known(self._peers, cmd.peer)
        self._staging[0, 0], self._staging[0, 1] = float(cmd.token), cmd.logprob
        if self._staging.is_cuda:  # the two stores run on the stream: the write reads after them
            torch.cuda.current_stream().synchronize()
        base = self.pool.data_ptr()
        runs = command_runs(cmd)
        local = [(base + s, n, self._dev) for s, _, n in runs] + [(self._staging.data_ptr(), META_SLOT_BYTES,
                                                                    self._dev)]
        remote = [(peer.pool_addr + d, n, peer.device) for _, d, n in runs] + [
            (peer.meta_addr + cmd.dst_meta_slot * META_SLOT_BYTES, META_SLOT_BYTES, peer.device)]
        self.wait(self._start(cmd.peer, cmd.room, local, remote, room_notif(cmd.room, cmd.transfers)))

    def post(self, chunk: ChunkSend) -> object:
        _, peer = _known(self._peers, chunk.peer)
        runs = chunk_runs(chunk)
        base = self.pool.data_ptr()
        return self._start(chunk.peer, chunk.room, [(base + s, n, self._dev) for s, _, n in runs],
                           [(peer.pool_addr + d, n, peer.device) for _, d, n in runs], room_notif(chunk.room, None))

    def _start(self, peer: str, room: int, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]],
               notif: bytes) -> tuple[object, int]:
        handle = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(local, self._mem),
                                            self.agent.get_xfer_descs(remote, self._mem), self._peers[peer][0], notif)
        try:
            if self.agent.transfer(handle) == "ERR":
                raise RuntimeError(f"room {room}: the NIXL transfer failed to start")
        except Exception:
            self.agent.release_xfer_handle(handle)
            raise
        return handle, room

    def wait(self, handle: object) -> None:
        xfer, room = handle  # type: ignore[misc]
        try:
            deadline = time.monotonic() + SEND_TIMEOUT_S
            while (state := self.agent.check_xfer_state(xfer)) not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"room {room}: the transfer did not finish within {SEND_TIMEOUT_S:g} s")
                time.sleep(0.0005)
            if state == "ERR":
                raise RuntimeError(f"room {room}: the NIXL transfer failed")
        finally:
            self.agent.release_xfer_handle(xfer)

    def poll(self) -> list[tuple[int, int | None]]:
        """The notifications come so far. The first call (a decode rank's, before any room's reservation goes
        out) starts `_progress`, from then on the only caller of the agent on this rank."""
        if self._poller is None:
            self._poller = threading.Thread(target=self._progress, name=f"{self.name}-progress", daemon=True)
            self._poller.start()
            atexit.register(self.close)  # stopped before the interpreter finalizes (a C++ call may be under way)
        with self._lock:
            out, self._notifs = self._notifs, []
        return out

    def _progress(self) -> None:
        """Every PROGRESS_INTERVAL_S: progress the agent (take in peers' writes, answer their flushes) and keep
        its notifications, so that a transfer into this rank never waits for its next step."""
        while not self._stop.wait(PROGRESS_INTERVAL_S):
            got = [parse_notif(n) for msgs in self.agent.get_new_notifs().values() for n in msgs]
            if got:
                with self._lock:
                    self._notifs.extend(got)

    def close(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join()


class FakeAgent:
    """In-process: every agent of the process is in `_AGENTS` by name; a send copies into the peer's buffers."""

    _AGENTS: dict[str, FakeAgent] = {}
    _ids = itertools.count()

    def __init__(self, pool: torch.Tensor, meta_slots: int) -> None:
        self.pool = pool
        self.meta = torch.zeros(meta_slots, _META_COLS, dtype=torch.float64, device=pool.device)
        self.name = f"fake-{next(self._ids)}"
        self._AGENTS[self.name] = self
        self._peers: dict[str, FakeAgent] = {}
        self._inbox: list[tuple[int, int | None]] = []

    def describe(self) -> RankAgent:
        return RankAgent(self.name, self.pool.data_ptr(), self.meta.data_ptr())

    def add_peer(self, peer: str, agent: RankAgent) -> None:
        self._peers[peer] = self._AGENTS[agent.agent]

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def send(self, cmd: SendCommand) -> None:
        peer = _known(self._peers, cmd.peer)
        self._copy(peer, command_runs(cmd))
        peer.meta[cmd.dst_meta_slot, 0], peer.meta[cmd.dst_meta_slot, 1] = float(cmd.token), cmd.logprob
        peer._inbox.append((cmd.room, cmd.transfers))

    def post(self, chunk: ChunkSend) -> object:
        peer = _known(self._peers, chunk.peer)
        self._copy(peer, chunk_runs(chunk))
        peer._inbox.append((chunk.room, None))
        return None

    def wait(self, handle: object) -> None:
        pass  # posted is landed: the copy is made when posted

    def _copy(self, peer: FakeAgent, runs: list[tuple[int, int, int]]) -> None:
        for s, d, n in runs:
            peer.pool[d : d + n].copy_(self.pool[s : s + n])

    def poll(self) -> list[tuple[int, int | None]]:
        out, self._inbox = self._inbox, []
        return out


def make_agent(backend: str, pool: torch.Tensor, meta_slots: int) -> TransferAgent:
    if backend == "nixl":
        return NixlAgent(pool, meta_slots)
    if backend == "fake":
        return FakeAgent(pool, meta_slots)
    raise ValueError(f"unknown transfer backend {backend!r}")
