"""The eviction cascade of :class:`~kvdist.manager.CacheManager`: taking a free slot
of a tier, evicting its coldest block when there is none, and moving that block one
tier colder (GPU -> host -> disk) or dropping it; the copies the moves need reach the
transfer engine together at the end of each cascade (``_submit_moves``).

A mixin over the manager's state (the attributes annotated on ``EvictionCascade``, set
by ``CacheManager.__init__``), so the hot path pays no indirection. The manager's
invariants (``kvdist.manager``) hold between cascades; inside one a slot may be in
transit."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from .blocks import ACTIVE, CACHED, FREE, GPU, HOST, NO_SLOT, BlockMeta, SlotSpace
from .transfer import Route

if TYPE_CHECKING:
    from .blocks import FreeStack
    from .eviction import PriorityLRU
    from .manager import CacheCounters
    from .prefix import PrefixIndex
    from .recompute_policy import RecomputePolicy
    from .transfer import TransferEngine

__all__ = ["EvictionCascade", "HostObserver"]

_COPY_MANY_FROM = 32  # copies; fewer go to the engine one by one (see _queue_copies)


class HostObserver(Protocol):
    """Who must know when a host slot's block changes (global slot ids)."""

    def host_filled(self, slot: int) -> None:
        """``slot`` now holds a cached block; the copy into it may still be queued."""

    def host_emptied(self, slot: int) -> None:
        """``slot`` no longer holds its block (it is free; its bytes stay until reused)."""


class EvictionCascade:
    """Slots from free stacks and eviction lists, blocks moved one tier colder."""

    meta: BlockMeta
    space: SlotSpace
    free: list[FreeStack | None]
    lru: list[PriorityLRU]
    index: PrefixIndex
    engine: TransferEngine
    policy: RecomputePolicy
    offload_min_priority: int
    counters: CacheCounters
    transfer_seconds: float
    host_observer: HostObserver | None
    _colder: dict[int, list[Route]]
    _moves: tuple[list[int], list[int], list[Route]]

    def _move(self, src: int, dst: int, along: Route) -> None:
        """Move the cached block in ``src`` (of tier ``along.src``) to the free slot
        ``dst`` (of tier ``along.dst``): an exclusive move, ``src`` ends on its free
        stack. The copy reaches the engine at the next ``_submit_moves``."""
        meta = self.meta
        srcs, dsts, routes = self._moves
        srcs.append(src)
        dsts.append(dst)
        routes.append(along)
        meta.move(src, dst)
        self.index.retarget(src, dst)
        meta.state_mv[dst] = CACHED
        meta.state_mv[src] = FREE
        self.free[along.src].push(src)
        self.counters.blocks_moved[along.name] += 1
        if self.host_observer is not None:
            if along.src == HOST:
                self.host_observer.host_emptied(src)
            if along.dst == HOST:
                self.host_observer.host_filled(dst)

    def _submit_moves(self) -> None:
        """Queue the moves made since the last call with the engine, in their order."""
        srcs, dsts, routes = self._moves
        if not srcs:
            return
        t0 = time.perf_counter()
        if routes.count(routes[0]) == len(routes):
            self._queue_copies(routes[0], srcs, dsts)
        else:
            start = 0
            for i in range(1, len(routes) + 1):
                if i == len(routes) or routes[i] is not routes[start]:
                    self._queue_copies(routes[start], srcs[start:i], dsts[start:i])
                    start = i
        srcs.clear()
        dsts.clear()
        routes.clear()
        self.transfer_seconds += time.perf_counter() - t0

    def _queue_copies(self, along: Route, srcs: list[int], dsts: list[int]) -> None:
        """Copies of one route: ``copy_many`` costs about as much as 24 single copies
        up front and a quarter of one per copy after that."""
        if len(srcs) < _COPY_MANY_FROM:
            copy = self.engine.copy
            for s, d in zip(srcs, dsts):
                copy(along, s, d)
        else:
            self.engine.copy_many(along, srcs, dsts)

    # -- the eviction cascade -----------------------------------------------------------------
    def _take_slot(self, tier: int) -> int:
        """A free slot of ``tier``, evicting its coldest block if needed; NO_SLOT if the
        tier has no free and no evictable slot."""
        s = self.free[tier].pop()
        if s != NO_SLOT:
            return s
        victim = self.lru[tier].pop_victim()
        if victim == NO_SLOT:
            return NO_SLOT
        self._evict(victim)
        return self.free[tier].pop()

    def _evict(self, slot: int) -> None:
        """Evict the unreferenced cached block in ``slot`` (already out of the lists):
        move it one tier colder, or drop it; the slot ends on its free stack."""
        meta = self.meta
        tier = GPU if slot < self.space.base[HOST] else self.space.tier_of(slot)
        self.counters.evictions[tier] += 1
        if not (tier == GPU and meta.prio_mv[slot] < self.offload_min_priority):
            for along in self._colder[tier]:
                if not self.policy.worth_storing(along.dst):
                    continue  # never onboarded back from there: drop, do not write it
                dst = self._take_slot(along.dst)
                if dst != NO_SLOT:
                    self._move(slot, dst, along)
                    self.lru[along.dst].push(dst)
                    return
        self.index.remove(slot)
        meta.state_mv[slot] = FREE
        self.free[tier].push(slot)
        self.counters.dropped += 1
        if tier == HOST and self.host_observer is not None:
            self.host_observer.host_emptied(slot)

    def _make_free(self, tier: int, n: int) -> None:
        """Evict the coldest blocks of ``tier`` until it has ``n`` free slots (or
        nothing is left to evict), and hand the moves to the engine."""
        free, lru = self.free[tier], self.lru[tier]
        while len(free) < n and (victim := lru.pop_victim()) != NO_SLOT:
            self._evict(victim)
        self._submit_moves()

    def _alloc_gpu(self, n: int, priority: int) -> list[int]:
        """``n`` fresh GPU slots in state ACTIVE, refcount 1. The caller checked that
        free + evictable >= n."""
        self._make_free(GPU, n)
        slots = self.free[GPU].pop_many(n)
        meta = self.meta
        for s in slots:
            meta.state_mv[s] = ACTIVE
            meta.ref_mv[s] = 1
            meta.prio_mv[s] = priority
        return slots
