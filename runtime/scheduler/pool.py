"""The unified two-ended pool's allocator: metadata only (the scheduler's side; the bytes live in
`runtime.worker.pool_buffer.PoolBuffer` on the workers).

KDA state blocks are taken from the top of the byte range downwards, MLA KV pages from the bottom
upwards; each side reuses its own holes first. When the sides meet, room is made in this order:
  1. compact the other side, if its holes alone can fund the request (free bytes: nothing is lost);
  2. ask the evictor (the radix cache) for states, least recently used first: states go first, since one
     weighs as much as thousands of tokens of KV and evicting one leaves a tombstone whose KV still
     matches; for a KV allocation the next pass compacts the freed slots into room;
  3. then for KV (removing whole leaves), which funds a state allocation through compaction.
A block may be pinned (a P/D transfer writes into it from another machine): compaction never moves it,
and stops at it. Callers hold virtual ids. A compaction move rewrites one table entry and queues a
`CopyCommand` that the worker must apply (in order, before the next forward) to the buffer; resolve
physical slots only after the step's allocations are done.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Iterable
from typing import NamedTuple, Protocol

from runtime.pool_layout import CopyCommand, PoolGeometry, PoolLayout


class Kind(enum.Enum):
    STATE = "state"
    KV = "kv"


class PoolUsage(NamedTuple):
    state_blocks: int
    state_holes: int
    state_bytes: int  # bytes in live state blocks
    state_extent_bytes: int  # bytes from the lowest state slot in use to the top
    peak_state_bytes: int
    kv_pages: int
    kv_holes: int
    kv_bytes: int
    kv_extent_bytes: int
    peak_kv_bytes: int
    gap_bytes: int  # untouched bytes between the two sides
    compaction_moves: int


class PoolExhausted(RuntimeError):
    """Nothing more can be freed: every cached block is locked or the request is larger than the pool."""


class Evictor(Protocol):
    def evict(self, kind: Kind, units: int) -> int:
        """Free at least `units` blocks (state blocks or KV pages) of `kind` if possible; return how many."""
        ...


class _Side:
    """One end of the pool in rank order: rank 0 is the outermost block (page 0, or the top state slot);
    the extent is ranks [0, extent); holes are free ranks inside it. The innermost rank is never a hole.
    Virtual ids are never reused, so a stale id (double free, use after free) fails loudly."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.rank_of: dict[int, int] = {}  # live virtual id -> rank
        self._next_id = 0
        self.id_at: dict[int, int] = {}  # rank -> virtual id
        self.holes: set[int] = set()
        self._hole_heap: list[int] = []  # lowest hole first; lazily cleaned
        self.extent = 0
        self.peak_used = 0

    @property
    def used(self) -> int:
        return len(self.id_at)

    def take_hole(self) -> int | None:
        while self._hole_heap:
            rank = heapq.heappop(self._hole_heap)
            if rank in self.holes:
                self.holes.remove(rank)
                return rank
        return None

    def grow(self, n: int) -> range:
        ranks = range(self.extent, self.extent + n)
        self.extent += n
        return ranks

    def bind(self, rank: int) -> int:
        vid = self._next_id
        self._next_id += 1
        self.rank_of[vid] = rank
        self.id_at[rank] = vid
        self.peak_used = max(self.peak_used, len(self.id_at))
        return vid

    def rank(self, vid: int) -> int:
        rank = self.rank_of.get(vid)
        if rank is None:
            raise KeyError(f"virtual id {vid} is not allocated")
        return rank

    def release(self, vid: int) -> None:
        rank = self.rank_of.pop(vid, None)
        if rank is None:
            raise KeyError(f"virtual id {vid} is not allocated")
        del self.id_at[rank]
        self._add_hole(rank)

    def move_innermost(self, pinned: set[int]) -> tuple[int, int] | None:
        """Move the innermost block into the lowest hole; return (src_rank, dst_rank). None if there is no hole
        or the innermost block is pinned (a transfer writes into it)."""
        src = self.extent - 1
        if not self.holes or self.id_at.get(src) in pinned:
            return None
        dst = self.take_hole()
        if dst is None:
            return None
        vid = self.id_at.pop(src)
        self.id_at[dst] = vid
        self.rank_of[vid] = dst
        self._add_hole(src)
        return src, dst

    def _add_hole(self, rank: int) -> None:
        if rank == self.extent - 1:
            self.extent -= 1
            while self.extent and self.extent - 1 in self.holes:
                self.holes.remove(self.extent - 1)
                self.extent -= 1
        else:
            self.holes.add(rank)
            heapq.heappush(self._hole_heap, rank)
        if len(self._hole_heap) > 2 * len(self.holes) + 64:
            self._hole_heap = sorted(self.holes)

    def check_integrity(self, name: str) -> None:
        assert 0 <= self.extent <= self.capacity, f"{name}: extent {self.extent} outside [0, {self.capacity}]"
        used = set(self.id_at)
        assert not used & self.holes, f"{name}: ranks both used and free: {sorted(used & self.holes)[:8]}"
        assert used | self.holes == set(range(self.extent)), f"{name}: extent has untracked ranks"
        assert self.extent == 0 or self.extent - 1 not in self.holes, f"{name}: innermost rank is a hole"
        assert self.holes <= set(self._hole_heap), f"{name}: a hole is missing from the hole heap"
        assert self.rank_of == {vid: r for r, vid in self.id_at.items()}, f"{name}: id table and rank map disagree"
        assert all(vid < self._next_id for vid in self.rank_of), f"{name}: id from the future"
        assert self.peak_used >= len(self.id_at), f"{name}: peak below current use"


class UnifiedPool:
    """Allocator metadata of one rank's pool of `total_bytes`.

    `kv_limit_bytes` fixes the boundary between the sides (a static split, kept as the baseline that the
    unified pool is measured against); None lets the sides meet anywhere.
    """

    def __init__(self, layout: PoolLayout, total_bytes: int, *, kv_limit_bytes: int | None = None) -> None:
        self.layout = layout
        self.geometry: PoolGeometry = layout.geometry(total_bytes)
        g = self.geometry
        if kv_limit_bytes is not None and not 0 <= kv_limit_bytes <= g.total_bytes:
            raise ValueError(f"kv_limit_bytes {kv_limit_bytes} outside [0, {g.total_bytes}]")
        self.kv_limit_bytes = kv_limit_bytes
        self._kv = _Side(g.num_pages)
        self._st = _Side(g.num_state_slots)
        self._copies: list[CopyCommand] = []
        self._page_moves: list[tuple[int, int]] = []  # (src, dst) physical pages moved by compaction
        self._evictor: Evictor | None = None
        self._moves = 0
        self._pinned: dict[Kind, set[int]] = {Kind.STATE: set(), Kind.KV: set()}

    def attach_evictor(self, evictor: Evictor) -> None:
        self._evictor = evictor

    # --- allocation ------------------------------------------------------------------------------------
    def alloc_state(self) -> int:
        """One state block's virtual id; evicts or compacts to make room, else raises PoolExhausted."""
        while True:
            rank = self._st.take_hole()
            if rank is None and self._state_room() > 0:
                rank = self._st.grow(1)[0]
            if rank is not None:
                return self._st.bind(rank)
            if not self._make_room(Kind.STATE, 1):
                raise PoolExhausted(f"no room for a state block: {self.usage()}")

    def alloc_pages(self, n: int) -> list[int]:
        """`n` KV pages' virtual ids (all or none)."""
        got: list[int] = []
        try:
            while len(got) < n:
                while len(got) < n and (rank := self._kv.take_hole()) is not None:
                    got.append(self._kv.bind(rank))
                for rank in self._kv.grow(min(n - len(got), self._kv_room())):
                    got.append(self._kv.bind(rank))
                if len(got) < n and not self._make_room(Kind.KV, n - len(got)):
                    raise PoolExhausted(f"no room for {n - len(got)} more KV pages: {self.usage()}")
        except PoolExhausted:
            self.free_pages(got)
            raise
        return got

    def free_state(self, vid: int) -> None:
        self._st.release(vid)

    def free_pages(self, vids: Iterable[int]) -> None:
        for vid in vids:
            self._kv.release(vid)

    def pin(self, kind: Kind, vids: Iterable[int]) -> None:
        """Compaction must not move these blocks (a transfer into them is in flight) until `unpin`."""
        self._pinned[kind].update(vids)

    def unpin(self, kind: Kind, vids: Iterable[int]) -> None:
        self._pinned[kind].difference_update(vids)

    def copy_state(self, src: int, dst: int) -> None:
        """Queue a byte copy of state block `src` into state block `dst` (copy on hit, decode checkpoints)."""
        if src == dst:
            raise ValueError("copy_state onto itself")
        sb = self.geometry.state_block_bytes
        self._copies.append(CopyCommand(self._state_byte(src), self._state_byte(dst), sb))

    def compact(self, kind: Kind) -> int:
        """Move all of one side's holes to its inner edge; return the number of blocks moved."""
        side = self._st if kind is Kind.STATE else self._kv
        moved = 0
        while side.holes and self._move(kind):
            moved += 1
        return moved

    def drain_copies(self) -> list[CopyCommand]:
        """The byte copies queued since the last drain, in the order the worker must apply them."""
        out, self._copies = self._copies, []
        return out

    def drain_page_moves(self) -> list[tuple[int, int]]:
        """The (src, dst) physical KV pages that compaction moved since the last drain, in order: page
        tables that hold physical ids rename src to dst, one move after the other."""
        out, self._page_moves = self._page_moves, []
        return out

    # --- translation -----------------------------------------------------------------------------------
    def state_slot(self, vid: int) -> int:
        """The physical state slot (index into the per-layer state views) of state block `vid`."""
        return self._st.capacity - 1 - self._st.rank(vid)

    def page_index(self, vid: int) -> int:
        return self._kv.rank(vid)

    def is_state(self, vid: int) -> bool:
        return vid in self._st.rank_of

    def is_page(self, vid: int) -> bool:
        return vid in self._kv.rank_of

    def live_states(self) -> set[int]:
        return set(self._st.id_at.values())

    def live_pages(self) -> set[int]:
        return set(self._kv.id_at.values())

    # --- accounting ------------------------------------------------------------------------------------
    @property
    def states_used(self) -> int:
        return self._st.used

    @property
    def pages_used(self) -> int:
        return self._kv.used

    def fits_packed(self, pages: int, states: int) -> bool:
        """Whether `pages` KV pages and `states` state blocks fit at once, after compacting both sides."""
        g = self.geometry
        if pages > g.num_pages or states > g.num_state_slots or pages < 0 or states < 0:
            return False
        kv_end = pages * g.page_bytes
        state_start = g.state_base + (g.num_state_slots - states) * g.state_block_bytes
        if self.kv_limit_bytes is not None:
            return kv_end <= self.kv_limit_bytes <= state_start
        return kv_end <= state_start

    def usage(self) -> PoolUsage:
        g = self.geometry
        return PoolUsage(
            state_blocks=self._st.used,
            state_holes=len(self._st.holes),
            state_bytes=self._st.used * g.state_block_bytes,
            state_extent_bytes=self._st.extent * g.state_block_bytes,
            peak_state_bytes=self._st.peak_used * g.state_block_bytes,
            kv_pages=self._kv.used,
            kv_holes=len(self._kv.holes),
            kv_bytes=self._kv.used * g.page_bytes,
            kv_extent_bytes=self._kv.extent * g.page_bytes,
            peak_kv_bytes=self._kv.peak_used * g.page_bytes,
            gap_bytes=self._state_edge() - self._kv_edge(),
            compaction_moves=self._moves,
        )

    def check_integrity(self) -> None:
        self._kv.check_integrity("kv side")
        self._st.check_integrity("state side")
        assert self._pinned[Kind.KV] <= self._kv.rank_of.keys(), "a pinned page is not allocated"
        assert self._pinned[Kind.STATE] <= self._st.rank_of.keys(), "a pinned state block is not allocated"
        g = self.geometry
        assert self._kv_edge() <= self._state_edge(), (
            f"sides overlap: kv ends at {self._kv_edge()}, states start at {self._state_edge()}")
        if self.kv_limit_bytes is not None:
            assert self._kv_edge() <= self.kv_limit_bytes, "kv side crossed the fixed split"
            assert self._st.extent == 0 or self._state_edge() >= self.kv_limit_bytes, (
                "state side crossed the fixed split")
        for c in self._copies:
            assert c.nbytes > 0 and 0 <= c.src and 0 <= c.dst, f"bad copy {c}"
            assert max(c.src, c.dst) + c.nbytes <= g.total_bytes, f"copy {c} runs past the buffer"
            assert abs(c.src - c.dst) >= c.nbytes, f"copy {c} overlaps itself"

    # --- internals -------------------------------------------------------------------------------------
    def _state_byte(self, vid: int) -> int:
        return self.geometry.state_offset(self.state_slot(vid))

    def _kv_edge(self) -> int:
        return self._kv.extent * self.geometry.page_bytes

    def _state_edge(self) -> int:
        g = self.geometry
        return g.state_base + (self._st.capacity - self._st.extent) * g.state_block_bytes

    def _kv_room(self) -> int:
        """Pages the KV side can grow by without moving anything."""
        limit = self._state_edge()
        if self.kv_limit_bytes is not None:
            limit = min(limit, self.kv_limit_bytes)
        return max(0, (limit - self._kv_edge()) // self.geometry.page_bytes)

    def _state_room(self) -> int:
        g = self.geometry
        floor = self._kv_edge()
        if self.kv_limit_bytes is not None:
            floor = max(floor, self.kv_limit_bytes)
        lowest_slot = max(0, -(-(floor - g.state_base) // g.state_block_bytes))
        return max(0, self._st.capacity - self._st.extent - lowest_slot)

    def _move(self, kind: Kind) -> bool:
        """Move one side's innermost block into its lowest hole; False if it cannot (no hole, or pinned)."""
        g = self.geometry
        side = self._st if kind is Kind.STATE else self._kv
        moved = side.move_innermost(self._pinned[kind])
        if moved is None:
            return False
        src, dst = moved
        if kind is Kind.STATE:
            cap = self._st.capacity
            cmd = CopyCommand(g.state_offset(cap - 1 - src), g.state_offset(cap - 1 - dst), g.state_block_bytes)
        else:
            cmd = CopyCommand(g.page_offset(src), g.page_offset(dst), g.page_bytes)
            self._page_moves.append((src, dst))
        self._copies.append(cmd)
        self._moves += 1
        return True

    def _make_room(self, kind: Kind, n: int) -> bool:
        """One step towards room for `n` more blocks of `kind`; False when nothing more can be freed."""
        unified = self.kv_limit_bytes is None
        if unified and self._compact_other(kind, n):
            return True
        if self._evictor is None:
            return False
        if kind is Kind.STATE:
            return self._evictor.evict(Kind.STATE, n) > 0 or (
                unified and self._evictor.evict(Kind.KV, self._other_units(kind, n)) > 0)
        # With a fixed split, freed state slots can never become KV room.
        return (unified and self._evictor.evict(Kind.STATE, self._other_units(kind, n)) > 0) or (
            self._evictor.evict(Kind.KV, n) > 0)

    def _compact_other(self, kind: Kind, n: int) -> bool:
        g = self.geometry
        if kind is Kind.STATE:
            # One more state slot needs the KV side to end at or below that slot's start.
            if self._st.extent + 1 > self._st.capacity:
                return False
            target = g.state_base + (self._st.capacity - self._st.extent - 1) * g.state_block_bytes
            if self._kv.used * g.page_bytes > target or self._kv_edge() <= target:
                return False
            while self._kv_edge() > target:
                if not self._move(Kind.KV):
                    return False  # a pinned page stops it; the moves made so far stand (their copies are queued)
            return True
        # KV: compact states while it opens at least one page and until it opens `n`.
        packed_edge = g.state_base + (self._st.capacity - self._st.used) * g.state_block_bytes
        if packed_edge < self._kv_edge() + g.page_bytes or not self._st.holes:
            return False
        want = self._kv_edge() + n * g.page_bytes
        moved = False
        while self._st.holes and self._state_edge() < want and self._move(Kind.STATE):
            moved = True
        return moved and self._kv_room() > 0

    def _other_units(self, kind: Kind, n: int) -> int:
        """How many blocks of the other kind to evict so that compaction can fund `n` blocks of `kind`."""
        g = self.geometry
        if kind is Kind.STATE:
            target = g.state_base + (self._st.capacity - self._st.extent - n) * g.state_block_bytes
            excess = self._kv.used * g.page_bytes - target
            return max(1, -(-excess // g.page_bytes))
        packed_edge = g.state_base + (self._st.capacity - self._st.used) * g.state_block_bytes
        excess = self._kv_edge() + n * g.page_bytes - packed_edge
        return max(1, -(-excess // g.state_block_bytes))
