"""The slots of every tier as one component: free lists, eviction lists (priority-LRU),
reference counts, and the eviction cascade that frees a slot by moving the coldest
block one tier colder (GPU -> host -> disk) or dropping it. The copies the moves need
reach the transfer engine together (``submit_moves``), in order, one call per run of
one route.

The manager (``kvdist.manager``) and the remote tier's landing slots
(``kvdist.landing``) change slots only through this interface; the invariant checks
read a :class:`PoolSnapshot`. State it owns, per tier ``t``:

* ``free[t]``: the FREE slots (a stack; a queue for the host tier above a disk, see
  ``kvdist.blocks.FreeQueue``);
* ``lru[t]``: the CACHED slots no sequence references (refcount 0), coldest first;
* the moves queued since the last ``submit_moves`` (``kvdist.move_queue``; empty
  between calls of the manager: a slot is in transit only inside one call).

A CACHED slot is in its tier's eviction list iff its refcount is 0: ``pin`` and
``unpin`` keep the two together. ``generation`` grows with every change to the
slots, so an admission plan can tell whether it is still current.

Runs of moves along one route go at once (``move_run``: the slot arrays written with
numpy, one probe loop for the index): an admission's onboards, and the offloads of the
GPU's coldest blocks whenever the tier below has the free slots for all of them (else
block by block, each through the cascade). ``batch_moves = False`` moves block by block
throughout (``bench manager`` shows both).

No Python hook runs per block change. When host slots get or lose their blocks,
``host_observer`` hears it once per ``submit_moves``, before its copies reach the engine
(``_tell_host``: the run's host sources and destinations, read off its routes, and the
host drops since the last call), and once per block landed in the host tier. When a
cached block enters, moves between or leaves the tiers, its words go to the block
observer's log (the KV cache events, ``kvdist.events``, publish it once a step): the
pending moves are held in two u64 arrays already (``MoveQueue``), which go to the log
whole at ``submit_moves``; a drop, a landing and a registration (the manager's) are
written as they happen (``kvdist.block_log``; ``BlockObserver`` has the words). With no
observer, this costs one test per drop and per ``submit_moves``."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .block_log import log_change
from .block_observers import (
    LOG_DROPPED,
    LOG_LANDED,
    LOG_MOVED,
    LOG_REGISTERED,
    BlockObserver,
    HostObserver,
)
from .blocks import (
    ACTIVE,
    CACHED,
    DISK,
    FREE,
    GPU,
    HOST,
    LANDING,
    NO_SLOT,
    BlockMeta,
    FreeQueue,
    FreeStack,
    SlotSpace,
)
from .counters import CacheCounters
from .eviction import DEFAULT_PRIORITY, PriorityLRU
from .move_queue import MoveQueue
from .prefix import MASK64, VECTOR_FROM, PrefixIndex
from .recompute_policy import RecomputePolicy
from .transfer import PROMOTE, Route, TransferEngine, route

__all__ = ["LOG_DROPPED", "LOG_LANDED", "LOG_MOVED", "LOG_REGISTERED", "BlockObserver", "BlockPool",
           "HostObserver", "PoolSnapshot"]

def _as_list(parts: list) -> list[int]:
    """The ints of ``parts`` (lists or int arrays), in order, as one list."""
    if len(parts) == 1:
        return parts[0] if isinstance(parts[0], list) else parts[0].tolist()
    out: list[int] = []
    for p in parts:
        out.extend(p if isinstance(p, list) else p.tolist())
    return out


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """A copy of the pool's lists, for checks and digests (tier-indexed; a tier
    without slots has ``free`` None and an empty ``lru``)."""

    free: tuple[np.ndarray | None, ...]  # free slots, next to be taken first
    lru: tuple[np.ndarray, ...]  # evictable slots, next to be evicted first
    pending_moves: int  # moves not handed to the engine (0 between calls)


class BlockPool:
    """Free lists, eviction lists and pending moves of every tier (module docstring)."""

    def __init__(self, space: SlotSpace, meta: BlockMeta, index: PrefixIndex, engine: TransferEngine,
                 policy: RecomputePolicy, counters: CacheCounters, offload_min_priority: int = 0,
                 drop_behind_disk: bool = False):
        cap = space.capacity
        self.space, self.meta, self.index, self.engine = space, meta, index, engine
        self.policy, self.counters = policy, counters
        self.offload_min_priority = offload_min_priority
        # An offload never takes a host slot a demotion is still writing to disk (the host
        # would wait for the write): the host tier's coldest block is dropped for it
        # instead, not demoted. The disk tier then takes what the disk writes in time of
        # the room the manager's demote_ahead keeps (it asks for this only then). Whether a
        # write is done depends on timing, so the ranks of a TP group decide alike from
        # ``host_ready``: how many slots at the head of the host tier's free queue every
        # rank found no disk work touching, agreed (MIN) at each end_step. Offloads take
        # those; past them they drop. Every pop from the head uses one up.
        self.drop_behind_disk = drop_behind_disk and bool(cap[HOST] and cap[DISK])
        self.host_ready = cap[HOST]  # at the start no disk work touches any
        # The host tier reuses its oldest free slot first when disk writes may still be
        # reading the newest (FreeQueue), and so does the disk tier, whose newest free slot
        # a promotion's or a reload's read may still be reading (a demotion into it would
        # wait for that read, and an offload into the demoted host slot for the demotion);
        # on the GPU the last freed slot goes first.
        kinds = (FreeStack, FreeQueue if cap[DISK] else FreeStack, FreeQueue)
        self.free = [kinds[t](space.base[t], cap[t]) if cap[t] else None for t in (GPU, HOST, DISK)]
        self.lru = [PriorityLRU(meta) for _ in (GPU, HOST, DISK)]
        # Where a block evicted from tier t may go, in order of preference.
        self._colder = {GPU: [route(GPU, t) for t in (HOST, DISK) if cap[t]],
                        HOST: [route(HOST, DISK)] if cap[DISK] else [], DISK: []}
        self._gpu_end, self._host_end = space.base[HOST], space.base[DISK]
        self._queue = MoveQueue()  # the moves since the last submit_moves, in order
        self.host_observer: HostObserver | None = None
        self._host_dropped: list[int] = []  # host slots dropped since the last submit_moves
        self.block_log: BlockObserver | None = None  # who reads the block log (None: nobody)
        self.generation = 0  # grows with every change (see the module docstring)
        self.batch_moves = True  # runs of moves at once (see the module docstring)
        self.transfer_seconds = 0.0  # handing moves to the engine

    @property
    def block_observer(self) -> BlockObserver | None:
        """Who reads the block log (see ``BlockObserver``); None when nobody does."""
        return self.block_log

    @block_observer.setter
    def block_observer(self, observer: BlockObserver | None) -> None:
        assert not self._queue, "block observer changed while moves are pending"
        self.block_log = observer

    # -- counts ----------------------------------------------------------------------------------
    def free_count(self, tier: int) -> int:
        f = self.free[tier]
        return 0 if f is None else len(f)

    def available(self, tier: int) -> int:
        """Slots of ``tier`` that can be had now: free or evictable."""
        return self.free_count(tier) + len(self.lru[tier])

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.free if f is not None)

    # -- sequences' GPU slots ----------------------------------------------------------------------
    def allocate(self, n: int, priority: int) -> np.ndarray:
        """``n`` fresh GPU slots (int64) in state ACTIVE, refcount 1, evicting as needed
        (the moves are handed to the engine). The caller checked ``available(GPU) >= n``."""
        self.generation += 1
        self.make_free(GPU, n)
        slots = self.free[GPU].pop_many(n)
        meta = self.meta
        meta.state[slots] = ACTIVE
        meta.refcnt[slots] = 1
        meta.prio[slots] = priority
        return slots

    def pin(self, hits, priority: int) -> None:
        """Take a prompt's cached prefix (distinct slots) out of reach of eviction: a GPU
        hit gains a reference (and at least ``priority``), leaving its eviction list at
        the first; a host or disk hit leaves its eviction list (the caller moves it at
        once)."""
        self.generation += 1
        if len(hits) >= VECTOR_FROM:
            self._pin_run(np.asarray(hits, dtype=np.int64), priority)
            return
        hits = _as_list([hits])
        gpu_end, host_end, lru = self._gpu_end, self._host_end, self.lru
        ref, prio = self.meta.ref_mv, self.meta.prio_mv
        lru_gpu = lru[GPU]
        colder: tuple[list[int], list[int]] = ([], [])  # host, disk hits
        for s in hits:
            if s < gpu_end:
                if ref[s] == 0:
                    lru_gpu.remove(s)
                ref[s] += 1
                if prio[s] < priority:
                    prio[s] = priority
            else:
                colder[s >= host_end].append(s)
        for tier, slots in zip((HOST, DISK), colder):
            if slots:
                lru[tier].remove_many(slots)

    def _pin_run(self, hits: np.ndarray, priority: int) -> None:
        """``pin`` with numpy (the hits distinct: a prompt's blocks have distinct hashes)."""
        meta = self.meta
        on_gpu = hits < self._gpu_end
        g = hits[on_gpu]
        if len(g):
            self.lru[GPU].remove_many(g[meta.refcnt[g] == 0])  # first: the lists go by priority
            meta.refcnt[g] += 1
            meta.prio[g] = np.maximum(meta.prio[g], priority)
        if len(g) < len(hits):
            cold = hits[~on_gpu]
            on_disk = cold >= self._host_end
            self.lru[HOST].remove_many(cold[~on_disk])
            self.lru[DISK].remove_many(cold[on_disk])

    def unpin(self, slots: list[int]) -> None:
        """Drop one reference from each GPU slot of a released sequence (distinct
        slots): an unreferenced cached block becomes evictable, the last block first
        (the tail of a prefix is evicted before the blocks it depends on); any other
        unreferenced slot is freed."""
        self.generation += 1
        meta = self.meta
        if len(slots) >= VECTOR_FROM:
            back = np.asarray(slots, dtype=np.intp)[::-1]
            ref = meta.refcnt[back] - 1
            meta.refcnt[back] = ref
            gone = back[ref == 0]
            cached = meta.state[gone] == CACHED
            freed = gone[~cached]
            meta.state[freed] = FREE
            self.free[GPU].push_many(freed)
            self.lru[GPU].push_run(gone[cached])
            return
        ref, state, free_push = meta.ref_mv, meta.state_mv, self.free[GPU].push
        unreferenced: list[int] = []
        for s in reversed(slots):
            r = ref[s] - 1
            ref[s] = r
            if r == 0:
                if state[s] == CACHED:
                    unreferenced.append(s)
                else:
                    state[s] = FREE
                    free_push(s)
        self.lru[GPU].push_run(unreferenced)

    def register(self, slots: list[int]) -> None:
        """Index the filled blocks in ``slots`` (hashes in meta) as CACHED; a block
        already indexed in another slot stays private (ACTIVE) here."""
        self.generation += 1
        if len(slots) >= VECTOR_FROM:
            at = np.asarray(slots, dtype=np.intp)
            self.meta.state[at[self.index.insert_many(at)]] = CACHED
            return
        insert, state = self.index.insert, self.meta.state_mv
        for s in slots:
            if insert(s):
                state[s] = CACHED

    # -- moves -----------------------------------------------------------------------------------
    def move(self, src: int, dst: int, along: Route) -> None:
        """Move the cached block in ``src`` (of tier ``along.src``, out of its lists)
        to the free slot ``dst`` (of tier ``along.dst``): an exclusive move, ``src``
        ends on its free list. The copy reaches the engine at the next ``submit_moves``."""
        self.generation += 1
        meta, q = self.meta, self._queue
        if along is not q.last:  # a new run (MoveQueue's invariant), then the move's two words
            q.runs.append((along, len(q.srcs)))
            q.last = along
        q.srcs.append(src)
        q.dsts.append(dst)
        meta.move(src, dst)
        self.index.retarget(src, dst)
        meta.state_mv[dst] = CACHED
        meta.state_mv[src] = FREE
        self.free[along.src].push(src)
        self.counters.blocks_moved[along.name] += 1

    def move_run(self, srcs: list[int], dsts: list[int], along: Route) -> None:
        """``move`` of each pair, in order, at once (``batch_moves``); the slots of
        ``srcs`` and ``dsts`` are distinct."""
        if not self.batch_moves or len(srcs) < 2:
            for s, d in zip(_as_list([srcs]), _as_list([dsts]), strict=True):
                self.move(s, d, along)
            return
        assert len(srcs) == len(dsts), f"{len(srcs)} sources for {len(dsts)} destinations"
        self.generation += 1
        meta = self.meta
        si, di = np.asarray(srcs, dtype=np.int64), np.asarray(dsts, dtype=np.int64)
        self._queue.add_run(si, di, along)
        meta.move_many(si, di)
        self.index.retarget_many(si, di)
        meta.state[di] = CACHED
        meta.state[si] = FREE
        self.free[along.src].push_many(si)
        self.counters.blocks_moved[along.name] += len(srcs)

    def submit_moves(self) -> None:
        """Queue the moves made since the last call with the engine, in their order:
        each run of one route in one call. The host observer hears the host slots
        changed first (R2: their stamps go odd before any copy into them starts)."""
        q = self._queue
        if self.host_observer is not None and (q.srcs or self._host_dropped):
            self._tell_host()
        if not q.srcs:
            return
        t0 = time.perf_counter()
        q.hand_over(self.engine, self.block_log)
        self.transfer_seconds += time.perf_counter() - t0

    def _tell_host(self) -> None:
        """Hand the host observer (set) the host slots the pending moves empty and fill
        (by their routes) and those dropped since the last call, in one call."""
        emptied, filled = self._queue.host_changes()
        emptied = self._host_dropped + emptied
        self._host_dropped = []
        if emptied or filled:
            self.host_observer.host_changed(emptied, filled)

    def promote(self, cold: list[tuple[int, int]]) -> int:
        """Move the disk blocks of a prompt's cached prefix (``cold``: (slot, tier) of
        its host and disk hits, in prompt order) into host slots; the prefix's host
        blocks and the promoted ones become the host tier's most recently used, the
        tail's first. A disk block stays when no host slot can be had. The moves are
        handed to the engine. Returns the blocks promoted."""
        self.generation += 1
        for s, t in cold:  # out of reach of the cascade below
            self.lru[t].remove(s)
        promoted, placed = 0, []
        for s, t in cold:
            if t == DISK:
                h = self._take(HOST)
                if h != NO_SLOT:
                    self.move(s, h, PROMOTE)
                    promoted += 1
                    s, t = h, HOST
            placed.append((s, t))
        for s, t in reversed(placed):  # last block first: the prefix's tail leaves first
            self.lru[t].push(s)
        self.submit_moves()
        return promoted

    # -- the eviction cascade ----------------------------------------------------------------------
    def take_slot(self, tier: int) -> int:
        """A free slot of ``tier`` (off the free list, still FREE), evicting its coldest
        block if needed; NO_SLOT if the tier has no free and no evictable slot. The
        eviction's moves wait for ``submit_moves``."""
        self.generation += 1
        return self._take(tier)

    def _take(self, tier: int) -> int:
        s = self.free[tier].pop()
        if s != NO_SLOT:
            if tier == HOST and self.host_ready:
                self.host_ready -= 1
            return s
        victim = self.lru[tier].pop_victim()
        if victim == NO_SLOT:
            return NO_SLOT
        self._evict(victim)
        return self.free[tier].pop()

    def _evict(self, slot: int) -> None:
        """Evict the unreferenced cached block in ``slot`` (already out of the lists):
        move it one tier colder, or drop it; the slot ends on its free list."""
        meta = self.meta
        tier = GPU if slot < self._gpu_end else self.space.tier_of(slot)
        self.counters.evictions[tier] += 1
        if not (tier == GPU and meta.prio_mv[slot] < self.offload_min_priority):
            for along in self._colder[tier]:
                if not self.policy.worth_storing(along.dst):
                    continue  # never onboarded back from there: drop, do not write it
                dst = self._offload_slot() if along.dst == HOST else self._take(along.dst)
                if dst != NO_SLOT:
                    self.move(slot, dst, along)
                    self.lru[along.dst].push(dst)
                    return
        self._drop(slot)
        self.free[tier].push(slot)

    def _drop(self, slot: int) -> None:
        """The cached block in ``slot`` (out of the lists) leaves the cache; the slot is
        FREE, on no free list."""
        self.index.remove(slot)
        self.meta.state_mv[slot] = FREE
        self.counters.dropped += 1
        if self.host_observer is not None and self._gpu_end <= slot < self._host_end:
            self._host_dropped.append(slot)  # told at the next submit_moves
        if self.block_log is not None:
            log_change(self.block_log, LOG_DROPPED, slot, len(self._queue.srcs))

    def _offload_slot(self) -> int:
        """A host slot for an offload (see ``drop_behind_disk``), evicting if needed;
        NO_SLOT if none."""
        if not self.drop_behind_disk or (self.host_ready and len(self.free[HOST])):
            return self._take(HOST)
        victim = self.lru[HOST].pop_victim()
        if victim == NO_SLOT:
            return self._take(HOST)  # nothing to drop instead: the offload waits for the write
        self.counters.evictions[HOST] += 1
        self.counters.dropped_behind_disk += 1
        self._drop(victim)
        return victim

    def local_host_ready(self) -> int:
        """How many slots at the head of the host tier's free queue no disk work touches
        on this rank (timing-dependent: agree on the TP group's MIN, ``host_ready``).
        After ``submit_moves``: the moves are the engine's."""
        assert not self._queue, "local_host_ready before submit_moves"
        free = self.free[HOST]
        busy = self.engine.disk_pending(free.peek_many(len(free)))
        return int(busy.argmax()) if busy.any() else len(free)

    def make_free(self, tier: int, n: int) -> None:
        """Evict the coldest blocks of ``tier`` until it has ``n`` free slots (or
        nothing is left to evict), and hand the moves to the engine."""
        free, lru = self.free[tier], self.lru[tier]
        if len(free) < n:
            self.generation += 1
            if self.batch_moves:
                self._offload_run(tier, n - len(free))
            while len(free) < n and (victim := lru.pop_victim()) != NO_SLOT:
                self._evict(victim)
        self.submit_moves()

    def _offload_run(self, tier: int, n: int) -> None:
        """Up to ``n`` of ``tier``'s coldest blocks moved one tier colder at once, when
        that tier has a free slot for each of them (the moves ``_evict`` would make
        one by one, in the same order, into the same slots): a GPU tier evicting into
        the host tier that ``demote_ahead`` keeps room in. Else nothing."""
        if tier != GPU or not self._colder[GPU] or self.offload_min_priority:
            return
        along = self._colder[GPU][0]
        lru, below = self.lru[GPU], self.free[along.dst]
        n = min(n, len(lru))
        if n < 2 or len(below) < n or not self.policy.worth_storing(along.dst):
            return
        if self.drop_behind_disk:  # only the agreed ready slots (host_ready)
            n = min(n, self.host_ready)
            if n < 2:
                return
            self.host_ready -= n
        victims = lru.pop_victims(n)
        dsts = below.pop_many(n)
        self.counters.evictions[GPU] += n
        self.move_run(victims, dsts, along)
        self.lru[along.dst].push_run(dsts)

    # -- landing slots (blocks fetched from another replica) ------------------------------------------
    def reserve(self, tier: int) -> int:
        """A slot of ``tier`` in state LANDING (see ``take_slot``); NO_SLOT when none."""
        s = self.take_slot(tier)
        if s != NO_SLOT:
            self.meta.state_mv[s] = LANDING
            self.meta.prio_mv[s] = DEFAULT_PRIORITY
        return s

    def land(self, slot: int, h: int, priority: int = DEFAULT_PRIORITY) -> bool:
        """Landing ``slot`` holds the whole block of hash ``h``: it becomes a cached
        block, its tier's most recently used. False when ``h`` is indexed meanwhile:
        the slot is released instead."""
        meta = self.meta
        assert meta.state_mv[slot] == LANDING, f"slot {slot} is not a landing slot"
        self.generation += 1
        meta.hi_mv[slot] = h >> 64
        meta.lo_mv[slot] = h & MASK64
        if not self.index.insert(slot):
            self.release(slot)
            return False
        meta.state_mv[slot] = CACHED
        meta.prio_mv[slot] = priority
        self.lru[self.space.tier_of(slot)].push(slot)
        if self.host_observer is not None and self._gpu_end <= slot < self._host_end:
            self.host_observer.host_changed([], [slot])
        if self.block_log is not None:
            log_change(self.block_log, LOG_LANDED, slot, meta.lo_mv[slot])
        return True

    def release(self, slot: int) -> None:
        """Return landing ``slot`` to its tier's free slots."""
        assert self.meta.state_mv[slot] == LANDING, f"slot {slot} is not a landing slot"
        self.generation += 1
        self.meta.state_mv[slot] = FREE
        self.free[self.space.tier_of(slot)].push(slot)

    # -- checks ------------------------------------------------------------------------------------
    def snapshot(self) -> PoolSnapshot:
        return PoolSnapshot(tuple(None if f is None else f.snapshot() for f in self.free),
                            tuple(np.fromiter(iter(lru), dtype=np.int64) for lru in self.lru),
                            len(self._queue))

    def check_invariants(self) -> None:
        """The eviction lists' own links; every move handed to the engine; no more host
        slots agreed ready than are free."""
        assert not self._queue, f"{len(self._queue)} moves never reached the transfer engine"
        assert not self._host_dropped, f"host drops {self._host_dropped} never told to the host observer"
        assert not self.drop_behind_disk or self.host_ready <= len(self.free[HOST]), \
            f"{self.host_ready} host slots agreed ready, {len(self.free[HOST])} free"
        self._queue.check_invariants()
        for lru in self.lru:
            lru.check_invariants()
