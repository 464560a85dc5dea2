"""P/D disaggregation, the scheduler's half (runtime.disagg.protocol says what the two sides say): the scheduler
owns the pool metadata, the reservations and the request lifetimes; its workers move the bytes (plan commands).

Decode (`DecodeSide`): a request waits for memory; then its pages (for the whole prompt: no decode-side prefix
yet) and a state block are allocated and pinned (compaction must not move them while prefill writes into them),
and a metadata slot is taken. Its `RoomReserve` goes to prefill only once the worker has run the plan carrying
that allocation's compaction copies (a copy run after prefill's write would clobber it). Each plan then polls the
workers; a room that arrived joins the running batch with its first token, its state and its KV in place.

Prefill (`PrefillSide`): runs the bootstrap server and a control socket; a request waits until its room's
reservation has come, then runs as usual with max_new_tokens = 1. As the results of its prompt chunks come, the
pages they completed past decode's prefix go in the next plan (`pd_chunks`): the worker starts their write after
that plan's copies (so the pages are where the plan says) and waits for it after the forward (which never writes
a complete prompt page), so a long prompt's transfer runs beside its later chunks. When it is released (in no
step in flight), the rest of its pages, its state block and its first token go, as a send command, at the head
of the next plan: the worker writes them before that plan's copies can move them. Decode hears that a room failed
only once no write into its memory is in flight.

Faults: each side's link to a peer (`runtime.disagg.link.PeerLink`) reports the peer's death; the rooms between
them end then (decode frees their memory, prefill aborts their work and its workers forget the peer's agent),
not at --disaggregation-timeout.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import socket
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import zmq

from runtime.disagg.link import PeerLink
from runtime.disagg.protocol import (
    BootstrapEntry,
    PeerHello,
    RankAgent,
    RoomFailed,
    RoomReserve,
    check_peer,
    chunk_send,
    decode_control,
    encode_control,
    layout_fingerprint,
    pool_proposer,
    send_command,
)
from runtime.pool_layout import PoolLayout
from runtime.scheduler.pool import Kind, PoolExhausted, UnifiedPool
from runtime.scheduler.radix_cache import HybridRadixCache, MatchResult
from runtime.scheduler.request import Req
from runtime.server_args import ServerArgs

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.001  # how often an otherwise idle decode scheduler asks its workers which rooms arrived


def advertised_host(host: str) -> str:
    """The address peers reach this machine at, for a server bound to `host`."""
    if host in ("", "0.0.0.0", "::"):
        return socket.gethostbyname(socket.gethostname())
    return host


class _Control:
    """One server's control socket (PULL, bound on a free port) and its PUSH sockets to peers."""

    def __init__(self, host: str) -> None:
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.host = advertised_host(host)
        self.port = self.inbox.bind_to_random_port(f"tcp://{self.host}")
        self.address = f"tcp://{self.host}:{self.port}"

    def connect(self, address: str) -> PeerLink:
        return PeerLink(self.ctx, address)

    def drain(self) -> list[PeerHello | RoomReserve | RoomFailed]:
        out = []
        while self.inbox.poll(0):
            raw = self.inbox.recv()
            try:
                out.append(decode_control(raw))
            except Exception:  # a stray or malformed message is dropped, never the scheduler
                log.warning("P/D: dropped a control message that does not parse (%d bytes)", len(raw), exc_info=True)
        return out

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@dataclass
class _DecodePeer:
    socket: PeerLink | None
    error: str | None


@dataclass
class _Room:
    req: Req
    slot: int
    deadline: float
    step: int  # the plan that carries the allocation's compaction copies: the reservation goes once it ran
    peer: _DecodePeer
    sent: bool = False
    # Its request already ended (failed or aborted, its client told); the room only holds the memory prefill may
    # still write into, until prefill's word, the write's arrival, the peer's death or a second deadline.
    orphan: bool = False


@dataclass
class _Outgoing:
    """A prefill room's prompt pages (indices into the request's pages) gone chunk by chunk so far."""

    req: Req
    sent: int  # pages [decode's prefix, sent) are in a plan's chunk writes
    ready: int = 0  # pages [.., ready) are complete: computed by steps whose result came
    chunks: int = 0  # chunk writes planned


class DecodeSide:
    def __init__(self, args: ServerArgs, pool: UnifiedPool, agents: list[RankAgent], tp_size: int,
                 cache: HybridRadixCache | None) -> None:
        """`cache`: the radix cache whose prefix hits skip pages (--disaggregation-decode-enable-radix-cache)."""
        self.args, self.pool = args, pool
        self.cache = cache if args.disaggregation_decode_enable_radix_cache else None
        self.ps = pool.geometry.page_size
        self.id = uuid.uuid4().hex
        self.control = _Control(args.host)
        self.fingerprint = layout_fingerprint(pool.layout, tp_size)
        self.tp_size = tp_size
        self.proposer = pool_proposer(args.speculative_algorithm)
        self.hello = PeerHello(self.id, agents, tp_size, self.ps, self.fingerprint, self.control.address,
                               self.proposer)
        self.peers: dict[tuple[str, int], _DecodePeer] = {}
        self.pending: deque[tuple[Req, float]] = deque()  # waiting for memory, with their deadline
        self.rooms: dict[int, _Room] = {}
        self._expect: list[tuple[int, int]] = []
        self._free_slots = list(range(max(args.max_running_requests, 1)))[::-1]
        self._failed: list[tuple[Req, str]] = []
        self._aborted: list[Req] = []
        self._last_poll = 0.0
        # Bootstrap lookups run in a thread: a dead prefill host must not stall the loop for the lookup's timeout.
        self._lookups: dict[tuple[str, int], Future[BootstrapEntry]] = {}
        self._lookup_pool = ThreadPoolExecutor(2, thread_name_prefix="pd-lookup")

    # --- requests ------------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        assert req.bootstrap is not None
        if req.bootstrap.room in self.rooms or any(r.bootstrap.room == req.bootstrap.room  # type: ignore[union-attr]
                                                   for r, _ in self.pending):
            self._failed.append((req, f"bootstrap room {req.bootstrap.room} is already in use on this server"))
            return
        self.pending.append((req, time.monotonic() + self.args.disaggregation_timeout))

    def abort(self, rid: str) -> None:
        for item in list(self.pending):
            if item[0].rid == rid:
                self.pending.remove(item)
                self._aborted.append(item[0])
                boot = item[0].bootstrap
                assert boot is not None
                peer = self.peers.get((boot.host, boot.port))
                if peer is not None and peer.socket is not None:  # prefill may hold the request already
                    self._tell(peer, RoomFailed(self.id, boot.room, "aborted by the client"))
        for room, r in list(self.rooms.items()):
            if r.req.rid == rid and not r.req.aborted:
                r.req.aborted = True  # its memory waits for the transfer (or prefill's word that none comes)
                self._tell(r.peer, RoomFailed(self.id, room, "aborted by the client"))
                if not r.sent:  # prefill never had the reservation: nothing will be written, the memory goes now
                    self._drop(room, "aborted by the client")

    @property
    def has_work(self) -> bool:
        return bool(self.pending or self.rooms or self._failed or self._aborted)

    @property
    def waiting_on_peer(self) -> bool:
        return bool(self.rooms or self._lookups)

    def holds(self) -> tuple[list[int], list[int]]:
        """The state blocks and the pages (past their tree pages) held by rooms not yet arrived."""
        return ([r.req.state for r in self.rooms.values()],  # type: ignore[misc]
                [p for r in self.rooms.values() for p in r.req.pages[r.req.tree_pages :]])

    # --- each schedule -------------------------------------------------------------------------------
    def reserve(self, running: int, step: int) -> None:
        """Reserve memory for waiting requests while rows and the pool allow (FIFO); `step`: the plan this
        schedule sends."""
        now = time.monotonic()
        self._read_control(now)
        self._forget_lost_peers()
        for room, r in list(self.rooms.items()):
            if now > r.deadline:
                self._drop(room, f"bootstrap room {room}: no transfer from the prefill server within "
                                 f"{self.args.disaggregation_timeout:g} s (--disaggregation-timeout)", hold=True)
        looking_up: list[tuple[Req, float]] = []  # their prefill server is being looked up: the next ones go first
        while self.pending and running + len(self.rooms) < self.args.max_running_requests:
            req, deadline = self.pending[0]
            boot = req.bootstrap
            assert boot is not None
            if now > deadline:
                self.pending.popleft()
                self._failed.append((req, "no memory for the request within --disaggregation-timeout"))
                continue
            peer = self._peer(boot.host, boot.port)
            if peer is None:
                looking_up.append(self.pending.popleft())
                continue
            if peer.error is not None:
                self.pending.popleft()
                self._failed.append((req, peer.error))
                continue
            if not self._alloc(req):
                break
            self.pending.popleft()
            slot = self._free_slots.pop()
            self.rooms[boot.room] = _Room(req, slot, now + self.args.disaggregation_timeout, step, peer)
            self._expect.append((boot.room, slot))
        self.pending.extendleft(reversed(looking_up))

    def _alloc(self, req: Req) -> bool:
        """A state block and the prompt's pages; with the decode-side radix cache, the tree's pages of a cached
        prefix (its node locked) and new pages past it. The blocks a transfer writes are pinned."""
        n_pages = -(-len(req.prompt_ids) // self.ps)
        match = self.cache.match_prefix(req.all_key_ids) if self.cache is not None else None
        if match is not None:
            self.cache.lock(match.node)  # type: ignore[union-attr]
        cached = list(match.pages) if match is not None else []
        try:
            state = self.pool.alloc_state()  # never the checkpoint's copy: prefill sends the whole state
        except PoolExhausted:
            self._unlock(match)
            return False
        try:
            pages = self.pool.alloc_pages(n_pages - len(cached))
        except PoolExhausted:
            self.pool.free_state(state)
            self._unlock(match)
            return False
        self.pool.pin(Kind.STATE, [state])
        self.pool.pin(Kind.KV, pages)
        req.state, req.pages, req.num_computed = state, cached + pages, len(req.prompt_ids)
        req.node, req.tree_pages = (match.node, len(cached)) if match is not None else (None, 0)
        req.cached_tokens = len(cached) * self.ps  # reported by decode alone (prefill's response is not returned)
        return True

    def can_draft(self, req: Req) -> bool:
        """Whether the worker's proposer can draft `req`'s next verify window. The MTP proposer keeps per
        page-table row each MTP layer's output at the last committed position, computed from the target's hidden
        there, which stays on the prefill server: decode's first step after the transfer runs without drafts and
        computes it (the MTP latents of the prompt came with its pages). The draft model's state and DSpark's
        context latents are in the state block and the pages: they came whole."""
        return not (self.args.speculative_algorithm == "mtp" and req.seq_len == len(req.prompt_ids) + 1)

    def _unlock(self, match: MatchResult | None) -> None:
        if match is not None:
            self.cache.unlock(match.node)  # type: ignore[union-attr]

    def plan_fields(self) -> dict[str, object]:
        expect, self._expect = self._expect, []
        if self.rooms:
            self._last_poll = time.monotonic()
        return {"pd_expect": expect, "pd_poll": bool(self.rooms)}

    @property
    def plan_due(self) -> bool:
        """Whether the next plan has something for the workers even with no sequence to run: rooms to expect,
        or rooms to poll for (at most every POLL_INTERVAL_S)."""
        return bool(self._expect) or bool(self.rooms) and time.monotonic() - self._last_poll >= POLL_INTERVAL_S

    def step_done(self, step: int, arrived: list[tuple[int, int, float]]) -> list[tuple[Req, int, float]]:
        """After step `step`'s result: send the reservations whose copies have run; take the rooms that arrived
        (request, first token, its logprob); aborted ones are let go here."""
        g = self.pool.geometry
        for room, r in self.rooms.items():
            if not r.sent and r.step <= step and not r.req.aborted:
                req = r.req
                offsets = [g.page_offset(self.pool.page_index(p)) for p in req.pages[req.tree_pages :]]
                state = g.state_offset(self.pool.state_slot(req.state))  # type: ignore[arg-type]
                self._tell(r.peer, RoomReserve(self.id, room, offsets, state, r.slot, req.tree_pages * self.ps))
                r.sent = True
        out = []
        for room, tok, lp in arrived:
            r = self.rooms.pop(room, None)
            if r is None:
                continue
            self._unpin(r.req)
            self._free_slots.append(r.slot)
            if r.req.aborted:
                self._let_go(r.req)
                if not r.orphan:
                    self._aborted.append(r.req)
            else:
                out.append((r.req, tok, lp))
        return out

    def take_failed(self) -> tuple[list[tuple[Req, str]], list[Req]]:
        """Requests that failed (with why) and that were aborted, their memory freed."""
        failed, self._failed = self._failed, []
        aborted, self._aborted = self._aborted, []
        return failed, aborted

    # --- internals -----------------------------------------------------------------------------------
    def _peer(self, host: str, port: int) -> _DecodePeer | None:
        """The prefill server whose bootstrap server is at host:port; None while it is being looked up."""
        key = (host, port)
        if key not in self.peers:
            future = self._lookups.get(key)
            if future is None:
                from runtime.disagg.bootstrap import lookup  # httpx: loaded by a P/D server's scheduler only

                self._lookups[key] = self._lookup_pool.submit(lookup, host, port)
                return None
            if not future.done():
                return None
            del self._lookups[key]
            try:
                entry = future.result()
            except Exception as e:  # not registered yet, or unreachable: retried by the next request
                return _DecodePeer(None, f"the prefill server's bootstrap server at {host}:{port} did not answer: "
                                         f"{type(e).__name__}: {e}")
            why = check_peer(self.tp_size, self.ps, self.fingerprint, entry.tp_size, entry.page_size,
                             entry.fingerprint, "prefill", self.proposer, entry.proposer)
            if why is not None:  # not kept: a prefill server restarted there with the right flags is looked up again
                return _DecodePeer(None, why)
            peer = _DecodePeer(self.control.connect(entry.address), None)
            peer.socket.send(encode_control(self.hello))  # type: ignore[union-attr]
            self.peers[key] = peer
        return self.peers[key]

    def _tell(self, peer: _DecodePeer, msg: RoomReserve | RoomFailed) -> None:
        assert peer.socket is not None
        peer.socket.send(encode_control(msg))

    def _read_control(self, now: float) -> None:
        for msg in self.control.drain():
            if isinstance(msg, RoomFailed) and msg.room in self.rooms:
                self._drop(msg.room, f"the prefill server failed bootstrap room {msg.room}: {msg.error}")

    def _forget_lost_peers(self) -> None:
        """A prefill server whose control connection closed is gone: its rooms fail now (their memory is freed),
        and the next request for its bootstrap address looks it up again (a server restarted there has another
        control address and agent)."""
        for (host, port), peer in list(self.peers.items()):
            if peer.socket is None or not peer.socket.lost:
                continue
            del self.peers[(host, port)]
            for room, r in list(self.rooms.items()):
                if r.peer is peer:
                    r.sent = False  # nobody to tell
                    self._drop(room, f"bootstrap room {room}: the prefill server at {host}:{port} went away (its "
                                     "control connection closed)")
            peer.socket.close()

    def _drop(self, room: int, error: str, hold: bool = False) -> None:
        """Give up on a room: its memory is freed and its request fails (or ends aborted). With `hold` (decode gave
        up by itself: a timeout) a room whose reservation went to prefill keeps its memory, pinned, as an orphan:
        a write prefill queued before our word reaches it may still land there. Prefill answers once no write
        into it is in flight (or the write arrives, or the peer dies, or a second timeout passes), and only
        then is the memory freed."""
        r = self.rooms.pop(room)
        if hold and r.sent and not r.orphan:
            self._orphan(room, r, error)
            return
        self._unpin(r.req)
        self._let_go(r.req)
        self._free_slots.append(r.slot)
        self._expect.append((room, -1))
        if r.orphan:
            return
        if r.req.aborted:
            self._aborted.append(r.req)
        else:
            self._failed.append((r.req, error))
            if r.sent:
                self._tell(r.peer, RoomFailed(self.id, room, error))

    def _orphan(self, room: int, r: _Room, error: str) -> None:
        """End `r`'s request now (its client hears at once) and keep its memory in the room (see `_drop`)."""
        held = copy.copy(r.req)
        held.aborted = True
        req = r.req
        req.state, req.pages, req.num_computed, req.node, req.tree_pages = None, [], 0, None, 0
        if req.aborted:
            self._aborted.append(req)
        else:
            self._failed.append((req, error))
            self._tell(r.peer, RoomFailed(self.id, room, error))
        deadline = time.monotonic() + self.args.disaggregation_timeout
        self.rooms[room] = dataclasses.replace(r, req=held, deadline=deadline, orphan=True)

    def _unpin(self, req: Req) -> None:
        self.pool.unpin(Kind.STATE, [req.state])  # type: ignore[list-item]
        self.pool.unpin(Kind.KV, req.pages[req.tree_pages :])

    def _let_go(self, req: Req) -> None:
        self.pool.free_state(req.state)  # type: ignore[arg-type]
        self.pool.free_pages(req.pages[req.tree_pages :])
        if req.node is not None:
            self.cache.unlock(req.node)  # type: ignore[union-attr]
        req.state, req.pages, req.num_computed, req.node, req.tree_pages = None, [], 0, None, 0

    def close(self) -> None:
        self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        self.control.close()


class PrefillSide:
    def __init__(self, args: ServerArgs, layout: PoolLayout, tp_size: int) -> None:
        self.args = args
        self.control = _Control(args.host)
        self.fingerprint = layout_fingerprint(layout, tp_size)
        self.tp_size, self.ps = tp_size, layout.page_size
        self.proposer = pool_proposer(args.speculative_algorithm)
        from runtime.disagg.bootstrap import BootstrapServer  # FastAPI and uvicorn: a P/D server's only

        self.bootstrap = BootstrapServer(args.host, args.disaggregation_bootstrap_port)
        self.bootstrap.register(BootstrapEntry(self.control.host, self.control.port, tp_size, layout.page_size,
                                               self.fingerprint, self.proposer))
        self.peers: dict[str, PeerLink] = {}
        self._new_peers: list[dict[str, object]] = []
        self._gone_peers: list[str] = []  # dead decode servers whose agents the workers are to forget
        self.reserves: dict[int, tuple[RoomReserve, float]] = {}  # came before their request
        self.waiting: dict[int, tuple[Req, float]] = {}  # requests waiting for their reservation
        self.admitted: dict[int, RoomReserve] = {}  # running requests' reservations
        self._rids: dict[int, str] = {}  # their request ids
        self._cancelled: dict[int, float] = {}  # rooms decode gave up on before their request came here
        self._sends: list[dict[str, object]] = []
        self._sending: dict[int, list[tuple[int, str]]] = {}  # step -> (room, decode_id) its plan sends
        self._ready: list[Req] = []
        self._failed: list[tuple[Req, str]] = []
        self._abort: list[str] = []  # admitted requests whose decode side gave up: abort them
        self._outgoing: dict[int, _Outgoing] = {}  # admitted rooms whose prompt chunks completed pages
        self._last_write_step: dict[int, int] = {}  # room -> the last plan carrying a write of it
        self._done_step = 0  # the last step whose result came
        self._deferred: list[tuple[str, int, str]] = []  # RoomFailed to tell once the room's writes ended

    def add(self, req: Req) -> None:
        room = req.bootstrap.room  # type: ignore[union-attr]
        if room in self.waiting or room in self.admitted:
            self._failed.append((req, f"bootstrap room {room} is already in use on this server"))
        elif self._cancelled.pop(room, None) is not None:
            self._failed.append((req, f"the decode server gave up on bootstrap room {room}"))
        elif room in self.reserves:
            self._admit(req, self.reserves.pop(room)[0])
        else:
            self.waiting[room] = (req, time.monotonic() + self.args.disaggregation_timeout)

    def _admit(self, req: Req, reserve: RoomReserve) -> None:
        """Admit `req` with decode's reservation, if it fits the prompt (both sides got the same one)."""
        room = reserve.room
        prefix_pages, pages = reserve.prefix_len // self.ps, -(-len(req.prompt_ids) // self.ps)
        if reserve.prefix_len % self.ps or len(reserve.page_offsets) != pages - prefix_pages:
            why = (f"bootstrap room {room}: decode reserved {len(reserve.page_offsets)} pages past a prefix of "
                   f"{reserve.prefix_len} tokens for a prompt of {len(req.prompt_ids)} tokens here: the two servers "
                   "got different prompts")
            self._failed.append((req, why))
            self.tell_failed(reserve.decode_id, room, why)
            return
        self.admitted[room] = reserve
        self._rids[room] = req.rid
        self._ready.append(req)

    def abort(self, rid: str) -> Req | None:
        for room, (req, _) in list(self.waiting.items()):
            if req.rid == rid:
                del self.waiting[room]
                return req
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self._sends or self._new_peers or self._ready or self._failed or self._abort
                    or self._gone_peers)

    @property
    def waiting_on_peer(self) -> bool:
        return bool(self.waiting)

    @property
    def plan_due(self) -> bool:
        return bool(self._sends or self._new_peers or self._gone_peers)

    def tick(self) -> tuple[list[Req], list[tuple[Req, str]], list[str]]:
        """Read decode's messages: requests whose reservation came (to admit), requests that failed, and the ids
        of admitted requests whose decode side gave up (to abort)."""
        now = time.monotonic()
        for msg in self.control.drain():
            if isinstance(msg, PeerHello):
                self._hello(msg)
            elif isinstance(msg, RoomReserve):
                if msg.decode_id not in self.peers:
                    continue  # a peer refused at its hello: it was told why
                if msg.room in self.waiting:
                    self._admit(self.waiting.pop(msg.room)[0], msg)
                else:
                    self.reserves[msg.room] = (msg, now + self.args.disaggregation_timeout)
            elif isinstance(msg, RoomFailed):
                self._decode_gave_up(msg, now)
        self._forget_lost_peers(now)
        for room, (req, deadline) in list(self.waiting.items()):
            if now > deadline:
                del self.waiting[room]
                self._failed.append((req, f"bootstrap room {room}: no decode server reserved memory within "
                                          f"{self.args.disaggregation_timeout:g} s (--disaggregation-timeout)"))
        for room, (_, deadline) in list(self.reserves.items()):
            if now > deadline:
                del self.reserves[room]
        self._cancelled = {r: d for r, d in self._cancelled.items() if d > now}
        ready, self._ready = self._ready, []
        failed, self._failed = self._failed, []
        abort, self._abort = self._abort, []
        return ready, failed, abort

    def _hello(self, msg: PeerHello) -> None:
        sock = self.control.connect(msg.address)
        why = check_peer(self.tp_size, self.ps, self.fingerprint, msg.tp_size, msg.page_size, msg.fingerprint,
                         "decode", self.proposer, msg.proposer)
        if why is not None:
            sock.send(encode_control(RoomFailed("prefill", -1, why)))
            return
        self.peers[msg.decode_id] = sock
        self._new_peers.append({"decode_id": msg.decode_id, "ranks": [dataclasses.asdict(r) for r in msg.ranks]})

    def _forget_lost_peers(self, now: float) -> None:
        """A decode server whose control connection closed is gone: the requests admitted for it are aborted
        (nothing would take their memory), its reservations dropped (a request for one fails when it comes)."""
        for decode_id, link in list(self.peers.items()):
            if not link.lost:
                continue
            del self.peers[decode_id]
            link.close()
            self._gone_peers.append(decode_id)
            for room, reserve in list(self.admitted.items()):
                if reserve.decode_id == decode_id:
                    del self.admitted[room]
                    self._abort.append(self._rids.pop(room))
            for room, (reserve, _) in list(self.reserves.items()):
                if reserve.decode_id == decode_id:
                    del self.reserves[room]
                    self._cancelled[room] = now + self.args.disaggregation_timeout

    def _decode_gave_up(self, msg: RoomFailed, now: float) -> None:
        """Decode aborted or failed a room whose memory it holds for us: the room is dropped here, a last write
        not yet planned is not to go, and decode is told it may free that memory once no write into it is in
        flight (`tell_failed` waits for those)."""
        room = msg.room
        if room in self.waiting:  # decode gave up before reserving: it holds nothing
            req, _ = self.waiting.pop(room)
            self._failed.append((req, f"the decode server gave up on bootstrap room {room}: {msg.error}"))
            return
        if room in self.admitted:
            del self.admitted[room]
            self._abort.append(self._rids.pop(room))
        elif room in self.reserves:
            del self.reserves[room]
            self._cancelled[room] = now + self.args.disaggregation_timeout  # its request may still come
        else:  # released here (its last write queued, in flight or done), or never seen
            self._cancelled[room] = now + self.args.disaggregation_timeout
            self._sends = [c for c in self._sends if c["room"] != room]
        if msg.sender in self.peers:
            self.tell_failed(msg.sender, room, "the prefill server dropped the room")

    def plan_fields(self, step: int) -> dict[str, object]:
        peers, self._new_peers = self._new_peers, []
        sends, self._sends = self._sends, []
        if sends:
            self._sending[step] = [(int(c["room"]), str(c["peer"])) for c in sends]  # type: ignore[call-overload]
            self._last_write_step.update((room, step) for room, _ in self._sending[step])
        forget, self._gone_peers = self._gone_peers, []
        return {"pd_peers": peers, "pd_sends": sends, "pd_forget": forget}

    def chunk_fields(self, step: int, pool: UnifiedPool) -> dict[str, object]:
        """The plan's chunk writes: each room's pages completed since its last one (resolved now, after this
        plan's compaction moves: the worker starts the writes after the plan's copies)."""
        chunks = []
        for room, o in list(self._outgoing.items()):
            reserve = self.admitted.get(room)
            if reserve is None:  # the room ended (released, aborted, dropped) since
                del self._outgoing[room]
                continue
            if o.ready <= o.sent:
                continue
            pages = [pool.page_index(p) for p in o.req.pages[o.sent : o.ready]]
            chunks.append(chunk_send(reserve, pool.geometry, pages, o.sent - reserve.prefix_len // self.ps).to_plan())
            o.sent, o.chunks = o.ready, o.chunks + 1
            self._last_write_step[room] = step
            self._sending.setdefault(step, []).append((room, reserve.decode_id))
        return {"pd_chunks": chunks}

    def chunks_done(self, seqs: list[tuple[Req, int]]) -> None:
        """A step's result came (not failed): each prefill sequence `(req, end)` computed its prompt up to `end`;
        the complete pages past decode's prefix go in the next plan."""
        for req, end in seqs:
            boot = req.bootstrap
            if boot is None or req.poisoned or req.finished or req.aborted:
                continue
            reserve = self.admitted.get(boot.room)
            if reserve is None:
                continue
            o = self._outgoing.setdefault(boot.room, _Outgoing(req, reserve.prefix_len // self.ps))
            done = min(end, len(req.prompt_ids))
            if self.proposer != "none" and done < len(req.prompt_ids):
                done -= 1  # the MTP layers write a chunk's last row with the next chunk (they need its next token)
            o.ready = max(o.sent, done // self.ps)

    def on_requeue(self, req: Req) -> None:
        """`req` lets go of its pages to be recomputed: the complete pages not sent yet are to be computed again
        (those already written to decode hold what it computed then)."""
        o = self._outgoing.get(req.bootstrap.room) if req.bootstrap is not None else None
        if o is not None:
            o.ready = o.sent

    def step_done(self, step: int, failed: list[tuple[int, str]]) -> None:
        """After step `step`'s result: decode hears of the sends that failed (a failed chunk write fails its
        request here), and of the rooms failed while writes into them were in flight."""
        self._done_step = step
        self._last_write_step = {r: s for r, s in self._last_write_step.items() if s > step}
        deferred, self._deferred = self._deferred, []
        for decode_id, room, error in deferred:
            self.tell_failed(decode_id, room, error)
        peer_of = dict(self._sending.pop(step, []))
        for room, error in dict(failed).items():
            if room in self.admitted:  # a chunk's write failed: the request stops here
                del self.admitted[room]
                self._abort.append(self._rids.pop(room))
            else:  # its last write, if not planned yet, is not to go either: decode frees the memory
                self._sends = [c for c in self._sends if c["room"] != room]
            if room in peer_of:
                self.tell_failed(peer_of[room], room, f"the transfer failed: {error}")

    def on_release(self, req: Req, pool: UnifiedPool) -> None:
        """`req` lets go of its memory: if it computed its prompt and sampled its first token, its memory goes
        to decode at the head of the next plan (before anything can move or overwrite it); else decode is told
        that nothing will come."""
        room = req.bootstrap.room  # type: ignore[union-attr]
        reserve = self.admitted.pop(room, None)
        self._rids.pop(room, None)
        out = self._outgoing.pop(room, None)
        if reserve is None or not reserve.decode_id:
            return
        ok = req.output_ids and not req.poisoned and not req.aborted and req.finished in ("stop", "length")
        if not ok:
            self.tell_failed(reserve.decode_id, room, "the prefill of the request failed or was aborted")
            return
        first = reserve.prefix_len // self.ps
        start = out.sent if out is not None else first
        pages = [pool.page_index(p) for p in req.pages[start : -(-len(req.prompt_ids) // self.ps)]]
        cmd = send_command(reserve, pool.geometry, pages, pool.state_slot(req.state),  # type: ignore[arg-type]
                           req.output_ids[0], req.first_logprob, start - first, out.chunks if out is not None else 0)
        self._sends.append(cmd.to_plan())

    def tell_failed(self, decode_id: str, room: int, error: str) -> None:
        if self._last_write_step.get(room, -1) > self._done_step:  # a write into decode's memory is in flight
            self._deferred.append((decode_id, room, error))
            return
        sock = self.peers.get(decode_id)
        if sock is not None:
            sock.send(encode_control(RoomFailed("prefill", room, error)))

    def close(self) -> None:
        self.bootstrap.close()
        self.control.close()
