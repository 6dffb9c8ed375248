"""Priority-then-LRU eviction order of one tier, as a log of slots per priority.

One list per priority (0..100); each runs from least to most recently used. A list is
an int32 array of slots in the order they were pushed, read from ``head`` to ``tail``:
a push appends at the tail, a slot removed from the middle (a reused block) leaves a
hole (NO_SLOT), and victims are taken from the head, skipping holes. Each listed slot's
index in its list's array is in :class:`~kvdist.blocks.BlockMeta` ``lru_pos`` (NO_SLOT
when it is in no list), so a removal is O(1) and needs no search. When a list's array
is full, its live slots are packed to the front (in order) or it doubles: O(1) a push,
amortized. Runs of slots (``push_run``, ``remove_many``, ``pop_victims``) are numpy
operations on the arrays: no Python work per slot. The lowest non-empty priority is
the lowest set bit of a bitmask.

Invariants (``check_invariants``): a slot is in list p's live range at index i iff
``lru_pos[slot] == i`` and its priority is p; ``live[p]`` counts the non-holes there,
and bit p of the mask is set iff ``live[p] > 0``."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .blocks import NO_SLOT, BlockMeta

__all__ = ["DEFAULT_PRIORITY", "NUM_PRIORITIES", "PriorityLRU"]

NUM_PRIORITIES = 101  # priorities 0..100, as TensorRT-LLM's retention priorities
DEFAULT_PRIORITY = 35
_FIRST_SIZE = 64  # a list's first array
_EMPTY = np.empty(0, dtype=np.int32)


class PriorityLRU:
    """Evictable slots of one tier, lowest priority first, then least recently used."""

    __slots__ = ("_log", "_mv", "_head", "_tail", "_live", "_nonempty", "_len", "_pos", "_pos_mv",
                 "_prio", "_prio_mv")

    def __init__(self, meta: BlockMeta):
        self._log: list[np.ndarray] = [_EMPTY] * NUM_PRIORITIES  # per priority: slots, holes NO_SLOT
        self._mv: list[memoryview] = [memoryview(_EMPTY)] * NUM_PRIORITIES  # the same, for scalar access
        self._head = [0] * NUM_PRIORITIES  # first index that may hold a live slot
        self._tail = [0] * NUM_PRIORITIES  # one past the last pushed
        self._live = [0] * NUM_PRIORITIES  # live slots in head..tail
        self._nonempty = 0
        self._len = 0
        self._pos, self._pos_mv = meta.lru_pos, meta.lru_pos_mv
        self._prio, self._prio_mv = meta.prio, meta.prio_mv

    def __len__(self) -> int:
        return self._len

    # -- the arrays ------------------------------------------------------------------------------
    def _room(self, p: int, k: int) -> None:
        """Make room for ``k`` pushes at list ``p``'s tail: pack its live slots to the
        front, into a larger array when they fill more than half of it."""
        log, live = self._log[p], self._live[p]
        if self._tail[p] + k <= len(log):
            return
        size = len(log) or _FIRST_SIZE
        while size < 2 * (live + k):
            size *= 2
        kept = log[self._head[p]: self._tail[p]]
        kept = kept[kept != NO_SLOT]
        if size != len(log):
            log = np.empty(size, dtype=np.int32)
            self._log[p], self._mv[p] = log, memoryview(log)
        log[:live] = kept
        self._pos[kept] = np.arange(live, dtype=np.int32)
        self._head[p], self._tail[p] = 0, live

    def _emptied(self, p: int) -> None:
        """List ``p`` holds no slot any more: it restarts at the front of its array."""
        self._head[p] = self._tail[p] = 0
        self._nonempty &= ~(1 << p)

    # -- one slot --------------------------------------------------------------------------------
    def push(self, slot: int) -> None:
        """Append ``slot`` as the most recently used of its priority (read from meta)."""
        p = self._prio_mv[slot]
        if self._tail[p] == len(self._log[p]):
            self._room(p, 1)
        i = self._tail[p]
        self._mv[p][i] = slot
        self._pos_mv[slot] = i
        self._tail[p] = i + 1
        self._live[p] += 1
        self._nonempty |= 1 << p
        self._len += 1

    def remove(self, slot: int) -> None:
        """Unlink ``slot``, which must be in this structure."""
        p, i = self._prio_mv[slot], self._pos_mv[slot]
        mv = self._mv[p]
        assert i != NO_SLOT and self._head[p] <= i < self._tail[p] and mv[i] == slot, \
            f"slot {slot} is not in eviction list {p}"
        mv[i] = NO_SLOT
        self._pos_mv[slot] = NO_SLOT
        self._live[p] -= 1
        self._len -= 1
        if not self._live[p]:
            self._emptied(p)

    def pop_victim(self) -> int:
        """Remove and return the next slot to evict, or NO_SLOT when empty."""
        m = self._nonempty
        if not m:
            return NO_SLOT
        p = (m & -m).bit_length() - 1
        mv, i = self._mv[p], self._head[p]
        while mv[i] == NO_SLOT:  # holes: each skipped once
            i += 1
        slot = mv[i]
        self._pos_mv[slot] = NO_SLOT
        self._head[p] = i + 1
        self._live[p] -= 1
        self._len -= 1
        if not self._live[p]:
            self._emptied(p)
        return slot

    # -- runs ------------------------------------------------------------------------------------
    def push_run(self, slots) -> None:
        """``push`` of each of ``slots`` (distinct, a list or an int array) in order, at
        once: each priority's slots appended to its list as one array."""
        s = np.asarray(slots, dtype=np.int32)
        if not len(s):
            return
        prio = self._prio[s]
        p0 = int(prio[0])
        if (prio == p0).all():  # the usual case: a sequence's blocks share a priority
            self._append(p0, s)
            return
        for p in np.unique(prio).tolist():  # a stable pick per priority keeps the order
            self._append(p, s[prio == p])

    def _append(self, p: int, s: np.ndarray) -> None:
        k = len(s)
        self._room(p, k)
        i = self._tail[p]
        self._log[p][i: i + k] = s
        self._pos[s] = np.arange(i, i + k, dtype=np.int32)
        self._tail[p] = i + k
        self._live[p] += k
        self._nonempty |= 1 << p
        self._len += k

    def remove_many(self, slots) -> None:
        """``remove`` of each of ``slots`` (distinct, a list or an int array), at once."""
        s = np.asarray(slots, dtype=np.int64)
        if not len(s):
            return
        prio, pos = self._prio[s], self._pos[s].astype(np.int64)
        p0 = int(prio[0])
        if (prio == p0).all():
            groups = [(p0, s, pos)]
        else:
            groups = [(p, s[prio == p], pos[prio == p]) for p in np.unique(prio).tolist()]
        for p, g, at in groups:
            log = self._log[p]
            assert (at >= self._head[p]).all() and (at < self._tail[p]).all() and (log[at] == g).all(), \
                f"a slot of {g.tolist()[:8]} is not in eviction list {p}"
            log[at] = NO_SLOT
            self._live[p] -= len(at)
            if not self._live[p]:
                self._emptied(p)
        self._pos[s] = NO_SLOT
        self._len -= len(s)

    def pop_victims(self, n: int) -> np.ndarray:
        """``pop_victim`` ``n`` times (fewer when the lists run out), as an int64 array:
        each list's next slots taken from its head at once."""
        out: list[np.ndarray] = []
        taken = 0
        while taken < n and self._nonempty:
            m = self._nonempty
            p = (m & -m).bit_length() - 1
            log, head, tail, want = self._log[p], self._head[p], self._tail[p], n - taken
            if self._live[p] <= want:  # the whole list
                win = log[head:tail]
                got = win[win != NO_SLOT]
                self._live[p] = 0
                self._emptied(p)
            else:  # windows of twice what is still wanted, until that many live slots are seen
                parts, end, left = [], head, want
                while left:
                    stop = min(tail, end + max(2 * left, 256))
                    win = log[end:stop]
                    at = np.flatnonzero(win != NO_SLOT)[:left]
                    parts.append(win[at])
                    left -= len(at)
                    end = end + int(at[-1]) + 1 if not left else stop
                got = np.concatenate(parts) if len(parts) > 1 else parts[0]
                self._head[p] = end
                self._live[p] -= len(got)
            out.append(got)
            taken += len(got)
        victims = np.concatenate(out).astype(np.int64) if out else np.empty(0, dtype=np.int64)
        self._pos[victims] = NO_SLOT
        self._len -= len(victims)
        return victims

    # -- reading ---------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        """Slots in eviction order (O(n); for tests and invariant checks)."""
        for p in range(NUM_PRIORITIES):
            if self._live[p]:
                win = self._log[p][self._head[p]: self._tail[p]]
                yield from win[win != NO_SLOT].tolist()

    def check_invariants(self) -> None:
        count = 0
        for p in range(NUM_PRIORITIES):
            head, tail, live = self._head[p], self._tail[p], self._live[p]
            assert bool(self._nonempty >> p & 1) == (live > 0), f"bitmask wrong at priority {p}"
            assert 0 <= head <= tail <= len(self._log[p]), f"list {p}: head {head}, tail {tail}"
            if head == tail:  # an empty window (most of the 101 lists): nothing more to read
                assert live == 0, f"list {p} holds no slot, live says {live}"
                continue
            win = self._log[p][head:tail]
            at = np.flatnonzero(win != NO_SLOT)
            slots = win[at]
            assert len(slots) == live, f"list {p} holds {len(slots)} slots, live says {live}"
            assert (self._prio[slots] == p).all(), f"a slot of another priority in list {p}"
            assert (self._pos[slots] == head + at).all(), f"list {p}: a slot's lru_pos is wrong"
            count += live
        assert count == self._len, f"eviction lists hold {count} slots, length says {self._len}"
