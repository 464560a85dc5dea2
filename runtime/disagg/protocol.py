"""What a decode server and a prefill server say to each other (P/D disaggregation, SGLang's shape), and the
transfer commands a scheduler puts in its workers' plans. Imports no torch: the schedulers speak it.

Per peer, once: decode sends `PeerHello`: each of its ranks' transfer agent (NIXL metadata, or the fake
backend's name) with the addresses of its registered pool and metadata buffer, and its layout fingerprint.
Per request: decode reserves pages, a state block and a metadata slot, pins them, and sends `RoomReserve` with
their byte offsets (each side's pool has its own size, so offsets, not ids, cross) and its prefix length; prefill
admits the request only then. As chunked prefill completes pages past the prefix, prefill's workers write them
(`ChunkSend`, each its own transfer); when the prompt is computed, the rest of the pages, the KDA state block and
the first token go in the room's last transfer (`SendCommand`). Every transfer notifies the room; the last one's
notification carries how many the room had, so decode sees the room complete only once all of them landed
(NIXL notifies each transfer after its own bytes, in no order across transfers).
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from runtime.pool_layout import PoolGeometry, PoolLayout

META_SLOT_BYTES = 16  # one metadata slot: the first token id and its logprob, two float64


@dataclass
class RankAgent:
    """One worker rank's transfer agent as its peers address it."""

    agent: str  # base64 of the NIXL agent metadata, or the fake backend's agent name
    pool_addr: int  # address of the registered pool buffer
    meta_addr: int  # address of the registered metadata slots (META_SLOT_BYTES each)
    device: int = 0  # the GPU both live on (CPU: 0)


@dataclass
class PeerHello:
    decode_id: str
    ranks: list[RankAgent]
    tp_size: int
    page_size: int
    fingerprint: str
    address: str  # decode's control socket: where prefill says that a room failed
    proposer: str = "none"  # its speculative proposer with a part in the pool (`pool_proposer`)

    def __post_init__(self) -> None:
        self.ranks = [r if isinstance(r, RankAgent) else RankAgent(**r) for r in self.ranks]


@dataclass
class RoomReserve:
    """Decode's memory for one room: byte offsets (in its pool) of the pages for prompt positions
    [prefix_len, ...), of the state block, and the metadata slot's index."""

    decode_id: str
    room: int
    page_offsets: list[int]
    state_offset: int
    meta_slot: int
    prefix_len: int = 0


@dataclass
class RoomFailed:
    """Either side gave up on a room (its request failed or was aborted): the other frees what it holds."""

    sender: str
    room: int
    error: str


CONTROL: dict[str, type] = {c.__name__: c for c in (PeerHello, RoomReserve, RoomFailed)}


def encode_control(msg: PeerHello | RoomReserve | RoomFailed) -> bytes:
    return orjson.dumps({"_type": type(msg).__name__, **asdict(msg)})


def decode_control(raw: bytes) -> PeerHello | RoomReserve | RoomFailed:
    body = orjson.loads(raw)
    return CONTROL[body.pop("_type")](**body)


def layout_fingerprint(layout: PoolLayout, tp_size: int) -> str:
    """Names the byte layout of a state block and a page on one rank: both sides must agree on it."""
    return hashlib.sha256(repr((layout, tp_size)).encode()).hexdigest()[:16]


def pool_proposer(speculative_algorithm: str | None) -> str:
    """The speculative proposer whose state lives in the pool (`PoolLayout.draft`) and moves with a request: the
    prefill server computes it over the prompt, so both sides must run the same one. n-gram keeps nothing there
    (decode looks its drafts up in the request's tokens and its own corpus): "none", as with no speculation."""
    return speculative_algorithm if speculative_algorithm in ("mtp", "draft", "dspark") else "none"


def check_peer(local_tp: int, local_page: int, local_fp: str, tp: int, page: int, fp: str, other: str,
               local_proposer: str = "none", proposer: str = "none") -> str | None:
    """Why the two sides cannot pair (None: they can)."""
    if tp != local_tp:
        return (f"the {other} server runs --tp {tp} and this one --tp {local_tp}: P/D disaggregation needs the same "
                "TP size on both sides (different TP sizes are not supported yet)")
    if page != local_page:
        return (f"the {other} server runs --page-size {page} and this one --page-size {local_page}: P/D "
                "disaggregation needs the same page size on both sides")
    if proposer != local_proposer:
        return (f"the {other} server's speculative proposer with state in the pool is {proposer} and this one's "
                f"{local_proposer}: with P/D disaggregation the prefill server computes the decode server's MTP, "
                "draft model or DSpark state over the prompt, so both run the same --speculative-algorithm (and "
                "draft model); n-gram needs nothing on the prefill server")
    if fp != local_fp:
        return (f"the {other} server's pool layout differs from this one's (another model, dtype or speculative "
                "draft): its state blocks and pages cannot be copied here")
    return None


@dataclass
class SendCommand:
    """A prefill rank's writes for one room, in a plan's `pd_sends`: its own byte offsets and the peer's."""

    peer: str  # decode_id
    room: int
    src_pages: list[int]
    dst_pages: list[int]
    page_bytes: int
    src_state: int
    dst_state: int
    state_bytes: int
    dst_meta_slot: int
    token: int
    logprob: float
    transfers: int = 1  # the room's transfers, this one included (its chunks' before it)

    def to_plan(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ChunkSend:
    """A prefill rank's write of pages a prompt chunk completed, in a plan's `pd_chunks`."""

    peer: str  # decode_id
    room: int
    src_pages: list[int]
    dst_pages: list[int]
    page_bytes: int

    def to_plan(self) -> dict[str, Any]:
        return asdict(self)


def _dst_pages(reserve: RoomReserve, start: int, n: int) -> list[int]:
    """Decode's offsets of `n` pages from the `start`-th page past its prefix."""
    if start + n > len(reserve.page_offsets):
        raise ValueError(f"room {reserve.room}: pages {start}..{start + n} to send, {len(reserve.page_offsets)} "
                         "reserved")
    return list(reserve.page_offsets[start : start + n])


def send_command(reserve: RoomReserve, geometry: PoolGeometry, pages: list[int], state_slot: int, token: int,
                 logprob: float, start: int = 0, chunks: int = 0) -> SendCommand:
    """The room's last writes from this (prefill) pool's physical `pages` and state slot into the offsets decode
    reserved: `pages` are the prompt's pages from the `start`-th past decode's prefix to the end (the first
    `start` went in `chunks` earlier transfers)."""
    if start + len(pages) != len(reserve.page_offsets):
        raise ValueError(f"room {reserve.room}: {start + len(pages)} pages to send, {len(reserve.page_offsets)} "
                         "reserved")
    return SendCommand(reserve.decode_id, reserve.room, [geometry.page_offset(p) for p in pages],
                       _dst_pages(reserve, start, len(pages)), geometry.page_bytes, geometry.state_offset(state_slot),
                       reserve.state_offset, geometry.state_block_bytes, reserve.meta_slot, token, logprob,
                       chunks + 1)


def chunk_send(reserve: RoomReserve, geometry: PoolGeometry, pages: list[int], start: int) -> ChunkSend:
    """The writes of physical `pages`, the prompt's pages from the `start`-th past decode's prefix on."""
    return ChunkSend(reserve.decode_id, reserve.room, [geometry.page_offset(p) for p in pages],
                     _dst_pages(reserve, start, len(pages)), geometry.page_bytes)


def room_notif(room: int, transfers: int | None) -> bytes:
    """A transfer's notification: its room, and on the room's last transfer how many the room had."""
    return (f"{room}" if transfers is None else f"{room}/{transfers}").encode()


def parse_notif(raw: bytes | str) -> tuple[int, int | None]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    room, _, total = text.partition("/")
    return int(room), int(total) if total else None


@dataclass
class TransferStats:
    """What a prefill rank's transfers moved in one step: how many, the MLA and KDA bytes, and the bytes and
    seconds of the writes it timed (the room's last write, which it waits for before the step's forward)."""

    transfers: int = 0
    kv_bytes: int = 0
    state_bytes: int = 0
    timed_bytes: int = 0
    timed_seconds: float = 0.0


@dataclass
class BootstrapEntry:
    """What a prefill server's bootstrap server tells a decode server (GET /route)."""

    rank_ip: str
    rank_port: int
    tp_size: int
    page_size: int
    fingerprint: str
    proposer: str = "none"

    @property
    def address(self) -> str:
        return f"tcp://{self.rank_ip}:{self.rank_port}"


def agent_text(metadata: bytes) -> str:
    return base64.b64encode(metadata).decode()


def agent_bytes(text: str) -> bytes:
    return base64.b64decode(text)
