"""A worker rank's transfer agent (P/D disaggregation): it registers the rank's pool buffer (one byte buffer, so
once) and a few metadata slots, and moves a room's bytes straight from this pool into a peer's registered memory.

`nixl`: NIXL over UCX (TCP on loopback or across machines here; RDMA / NVLink on GPUs). `fake`: the same
interface in one process (two LocalEngines in a unit test): byte copies between the registered buffers.
A prefill rank writes a room's pages, its state block and its metadata slot in one transfer that carries the
room as its notification; the decode rank polls its notifications.
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Protocol, TypeVar

import torch

from runtime.disagg.protocol import META_SLOT_BYTES, RankAgent, SendCommand, agent_bytes, agent_text

SEND_TIMEOUT_S = 30.0
_META_COLS = META_SLOT_BYTES // 8  # float64: the token id (exact below 2**53) and its logprob
T = TypeVar("T")


class TransferAgent(Protocol):
    meta: torch.Tensor  # [slots, 2] float64: the rooms' first token and its logprob, as the prefill side wrote them

    def describe(self) -> RankAgent: ...
    def add_peer(self, peer: str, agent: RankAgent) -> None: ...
    def remove_peer(self, peer: str) -> None: ...
    def send(self, cmd: SendCommand) -> None: ...
    def poll(self) -> list[int]: ...


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
    """A room's writes as (source pool offset, destination pool offset, bytes): its pages, then its state."""
    return [*_runs(cmd.src_pages, cmd.dst_pages, cmd.page_bytes), (cmd.src_state, cmd.dst_state, cmd.state_bytes)]


class NixlAgent:
    def __init__(self, pool: torch.Tensor, meta_slots: int) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.pool = pool
        self.meta = torch.zeros(meta_slots, _META_COLS, dtype=torch.float64, device=pool.device)
        self._staging = torch.zeros(1, _META_COLS, dtype=torch.float64, device=pool.device)
        self.name = f"radixk3-{uuid.uuid4().hex[:12]}"
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"]))
        self._mem = "VRAM" if pool.is_cuda else "DRAM"
        self._dev = (pool.device.index or 0) if pool.is_cuda else 0
        for t in (pool, self.meta, self._staging):
            self.agent.register_memory(self.agent.get_reg_descs(t, self._mem))
        self._peers: dict[str, tuple[str, RankAgent]] = {}

    def describe(self) -> RankAgent:
        return RankAgent(agent_text(self.agent.get_agent_metadata()), self.pool.data_ptr(), self.meta.data_ptr(),
                         self._dev)

    def add_peer(self, peer: str, agent: RankAgent) -> None:
        if peer not in self._peers:
            self._peers[peer] = (self.agent.add_remote_agent(agent_bytes(agent.agent)), agent)

    def remove_peer(self, peer: str) -> None:
        """A dead peer: its agent's metadata (and UCX endpoints) go."""
        if (known := self._peers.pop(peer, None)) is not None:
            self.agent.remove_remote_agent(known[0])

    def send(self, cmd: SendCommand) -> None:
        name, peer = _known(self._peers, cmd.peer)
        self._staging[0, 0], self._staging[0, 1] = float(cmd.token), cmd.logprob
        base = self.pool.data_ptr()
        runs = command_runs(cmd)
        local = [(base + s, n, self._dev) for s, _, n in runs] + [(self._staging.data_ptr(), META_SLOT_BYTES,
                                                                    self._dev)]
        remote = [(peer.pool_addr + d, n, peer.device) for _, d, n in runs] + [
            (peer.meta_addr + cmd.dst_meta_slot * META_SLOT_BYTES, META_SLOT_BYTES, peer.device)]
        handle = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(local, self._mem),
                                            self.agent.get_xfer_descs(remote, self._mem), name,
                                            str(cmd.room).encode())
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + SEND_TIMEOUT_S
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"room {cmd.room}: the transfer did not finish within {SEND_TIMEOUT_S:g} s")
                time.sleep(0.0005)
                state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError(f"room {cmd.room}: the NIXL transfer failed")
        finally:
            self.agent.release_xfer_handle(handle)

    def poll(self) -> list[int]:
        return [int(n) for msgs in self.agent.get_new_notifs().values() for n in msgs]


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
        self._inbox: list[int] = []

    def describe(self) -> RankAgent:
        return RankAgent(self.name, self.pool.data_ptr(), self.meta.data_ptr())

    def add_peer(self, peer: str, agent: RankAgent) -> None:
        self._peers[peer] = self._AGENTS[agent.agent]

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def send(self, cmd: SendCommand) -> None:
        peer = _known(self._peers, cmd.peer)
        for s, d, n in command_runs(cmd):
            peer.pool[d : d + n].copy_(self.pool[s : s + n])
        peer.meta[cmd.dst_meta_slot, 0], peer.meta[cmd.dst_meta_slot, 1] = float(cmd.token), cmd.logprob
        peer._inbox.append(cmd.room)

    def poll(self) -> list[int]:
        out, self._inbox = self._inbox, []
        return out


def make_agent(backend: str, pool: torch.Tensor, meta_slots: int) -> TransferAgent:
    if backend == "nixl":
        return NixlAgent(pool, meta_slots)
    if backend == "fake":
        return FakeAgent(pool, meta_slots)
    raise ValueError(f"unknown transfer backend {backend!r}")
