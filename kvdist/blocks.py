"""Per-slot block metadata as structure-of-arrays.

Every physical slot of every tier has one global id: GPU slots come first, then host,
then disk, so slot 0 of one tier never aliases slot 0 of another (rule S1). All
per-block state lives in numpy arrays indexed by that id (26 bytes a slot, and up to 8
more in the eviction lists' arrays); runs of slots are written with numpy, and single
entries read through memoryviews, which cost a third of numpy's scalar indexing. This
module knows slots, hashes and reference counts; nothing about requests or tensors."""

from __future__ import annotations

import numpy as np

GPU, HOST, DISK = 0, 1, 2
TIER_NAMES = ("gpu", "host", "disk")

# Slot states.
FREE = 0  # on its tier's free stack, holds nothing
ACTIVE = 1  # holds a block being filled, not in the prefix index
CACHED = 2  # holds a full block that is in the prefix index
LANDING = 3  # reserved for a block fetched from another replica, not agreed yet (remote tier)

NO_SLOT = -1


class SlotSpace:
    """Global slot numbering over the tiers: tier ``t`` owns ``[base[t], base[t] + cap[t])``."""

    __slots__ = ("capacity", "base", "total")

    def __init__(self, capacity: tuple[int, int, int]):
        assert all(c >= 0 for c in capacity), f"negative capacity {capacity}"
        self.capacity = tuple(capacity)
        self.base = (0, capacity[0], capacity[0] + capacity[1])
        self.total = sum(capacity)

    def tier_of(self, slot: int) -> int:
        assert 0 <= slot < self.total, f"slot {slot} outside 0..{self.total - 1}"
        if slot < self.base[1]:
            return GPU
        return HOST if slot < self.base[2] else DISK

    def local(self, slot: int) -> int:
        return slot - self.base[self.tier_of(slot)]


class FreeStack:
    """The free slots of one tier, as a stack in an int32 array: O(1) push and pop,
    vectorized bulk pop. Initially pops ascending slot ids."""

    __slots__ = ("_items", "_mv", "_top", "base", "capacity")

    def __init__(self, base: int, capacity: int):
        self.base = base
        self.capacity = capacity
        self._items = np.arange(base + capacity - 1, base - 1, -1, dtype=np.int32)
        self._mv = memoryview(self._items)
        self._top = capacity

    def __len__(self) -> int:
        return self._top

    @property
    def nbytes(self) -> int:
        return self._items.nbytes

    def push(self, slot: int) -> None:
        assert self._top < self.capacity, "free stack overflow: a slot was freed twice"
        self._mv[self._top] = slot
        self._top += 1

    def pop(self) -> int:
        if self._top == 0:
            return NO_SLOT
        self._top -= 1
        return self._mv[self._top]

    def push_many(self, slots: list[int]) -> None:
        """``push`` of each of ``slots``, in order."""
        n = len(slots)
        assert self._top + n <= self.capacity, "free stack overflow: a slot was freed twice"
        self._items[self._top: self._top + n] = slots
        self._top += n

    def pop_many(self, n: int) -> np.ndarray:
        """``pop`` ``n`` times, as an int64 array."""
        assert 0 <= n <= self._top, f"pop_many({n}) with {self._top} free"
        out = self._items[self._top - n : self._top][::-1].astype(np.int64)
        self._top -= n
        return out

    def snapshot(self) -> np.ndarray:
        """Free slots, next to pop first (for tests and invariant checks)."""
        return self._items[: self._top][::-1].copy()


class FreeQueue:
    """The free slots of one tier in first-freed, first-reused order: a ring in an
    int32 array, the same operations as :class:`FreeStack`. The host tier uses it when
    a disk tier sits below: a slot freed by a demotion is still being read by a disk
    worker, and reusing it at once (as a stack would: last freed, first popped) makes the
    next offload into it wait on the host for that write. In a queue it is reused after
    every slot freed before it, which is the time its write runs in. Initially pops
    ascending slot ids."""

    __slots__ = ("_items", "_mv", "_head", "_count", "base", "capacity")

    def __init__(self, base: int, capacity: int):
        assert capacity > 0, "an empty tier has no free list"
        self.base = base
        self.capacity = capacity
        self._items = np.arange(base, base + capacity, dtype=np.int32)
        self._mv = memoryview(self._items)
        self._head = 0  # next to pop
        self._count = capacity

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return self._items.nbytes

    def push(self, slot: int) -> None:
        assert self._count < self.capacity, "free queue overflow: a slot was freed twice"
        self._mv[(self._head + self._count) % self.capacity] = slot
        self._count += 1

    def pop(self) -> int:
        if self._count == 0:
            return NO_SLOT
        slot = self._mv[self._head]
        self._head = (self._head + 1) % self.capacity
        self._count -= 1
        return slot

    def push_many(self, slots: list[int]) -> None:
        """``push`` of each of ``slots``, in order."""
        n = len(slots)
        assert self._count + n <= self.capacity, "free queue overflow: a slot was freed twice"
        at = (self._head + self._count + np.arange(n)) % self.capacity
        self._items[at] = slots
        self._count += n

    def peek_many(self, n: int) -> np.ndarray:
        """The next ``n`` slots ``pop`` would give, left in the queue (int64)."""
        assert 0 <= n <= self._count, f"peek_many({n}) with {self._count} free"
        return self._ordered(n).astype(np.int64)

    def pop_many(self, n: int) -> np.ndarray:
        """``pop`` ``n`` times, as an int64 array."""
        assert 0 <= n <= self._count, f"pop_many({n}) with {self._count} free"
        out = self._ordered(n).astype(np.int64)
        self._head = (self._head + n) % self.capacity
        self._count -= n
        return out

    def _ordered(self, n: int) -> np.ndarray:
        end = self._head + n
        if end <= self.capacity:
            return self._items[self._head:end]
        return np.concatenate((self._items[self._head:], self._items[: end - self.capacity]))

    def snapshot(self) -> np.ndarray:
        """Free slots, next to pop first (for tests and invariant checks)."""
        return self._ordered(self._count).copy()


class BlockMeta:
    """Arrays indexed by global slot id: chained hash (two uint64), priority,
    reference count, state, and the slot's index in its eviction list's array
    (``lru_pos``, NO_SLOT when in none; see :mod:`kvdist.eviction`). ``*_mv`` are
    memoryviews of the same arrays for scalar access."""

    def __init__(self, total_slots: int):
        n = total_slots
        self.hash_hi = np.zeros(n, dtype=np.uint64)
        self.hash_lo = np.zeros(n, dtype=np.uint64)
        self.prio = np.zeros(n, dtype=np.uint8)
        self.refcnt = np.zeros(n, dtype=np.int32)
        self.state = np.zeros(n, dtype=np.uint8)
        self.lru_pos = np.full(n, NO_SLOT, dtype=np.int32)
        self.hi_mv = memoryview(self.hash_hi)
        self.lo_mv = memoryview(self.hash_lo)
        self.prio_mv = memoryview(self.prio)
        self.ref_mv = memoryview(self.refcnt)
        self.state_mv = memoryview(self.state)
        self.lru_pos_mv = memoryview(self.lru_pos)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.hash_hi, self.hash_lo, self.prio, self.refcnt,
                                      self.state, self.lru_pos))

    def move_many(self, srcs: np.ndarray, dsts: np.ndarray) -> None:
        """``move`` for each pair (the slots of ``dsts`` distinct from those of ``srcs``)."""
        for a in (self.hash_hi, self.hash_lo, self.prio):
            a[dsts] = a[srcs]

    def move(self, src: int, dst: int) -> None:
        """Copy the identity of the block in ``src`` (hash, priority) to ``dst``."""
        self.hi_mv[dst] = self.hi_mv[src]
        self.lo_mv[dst] = self.lo_mv[src]
        self.prio_mv[dst] = self.prio_mv[src]
