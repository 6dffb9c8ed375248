"""Priority-then-LRU eviction order of one tier, as intrusive doubly linked lists.

One list per priority (0..100); each list runs from least to most recently used.
The links live in :class:`~kvdist.blocks.BlockMeta` ``prev``/``next`` arrays, so a
list costs no memory per block beyond those arrays, and every operation is O(1):
push, remove from the middle (a reused block), pop the victim. The lowest
non-empty priority is the lowest set bit of a bitmask."""

from __future__ import annotations

from collections.abc import Iterator

from .blocks import NO_SLOT, BlockMeta

NUM_PRIORITIES = 101  # priorities 0..100, as TensorRT-LLM's retention priorities
DEFAULT_PRIORITY = 35


class PriorityLRU:
    """Evictable slots of one tier, lowest priority first, then least recently used."""

    __slots__ = ("_head", "_tail", "_nonempty", "_len", "_prev", "_next", "_prio")

    def __init__(self, meta: BlockMeta):
        self._head = [NO_SLOT] * NUM_PRIORITIES
        self._tail = [NO_SLOT] * NUM_PRIORITIES
        self._nonempty = 0
        self._len = 0
        self._prev = meta.prev_mv
        self._next = meta.next_mv
        self._prio = meta.prio_mv

    def __len__(self) -> int:
        return self._len

    def push(self, slot: int) -> None:
        """Append ``slot`` as the most recently used of its priority (read from meta)."""
        p = self._prio[slot]
        tail = self._tail[p]
        self._prev[slot] = tail
        self._next[slot] = NO_SLOT
        if tail == NO_SLOT:
            self._head[p] = slot
            self._nonempty |= 1 << p
        else:
            self._next[tail] = slot
        self._tail[p] = slot
        self._len += 1

    def push_run(self, slots: list[int]) -> None:
        """``push`` of each of ``slots`` in order, in one pass without a call per slot:
        consecutive slots of one priority are linked to each other directly (a released
        sequence's blocks mostly share one)."""
        prv, nxt, prio, heads, tails = self._prev, self._next, self._prio, self._head, self._tail
        cur = tail = NO_SLOT
        for s in slots:
            p = prio[s]
            if p != cur:
                if cur != NO_SLOT:
                    nxt[tail] = NO_SLOT
                    tails[cur] = tail
                cur, tail = p, tails[p]
                if tail == NO_SLOT:
                    heads[p] = s
                    self._nonempty |= 1 << p
            prv[s] = tail
            if tail != NO_SLOT:
                nxt[tail] = s
            tail = s
        if cur != NO_SLOT:
            nxt[tail] = NO_SLOT
            tails[cur] = tail
        self._len += len(slots)

    def remove(self, slot: int) -> None:
        """Unlink ``slot``, which must be in this structure."""
        p = self._prio[slot]
        prv, nxt = self._prev[slot], self._next[slot]
        if prv == NO_SLOT:
            assert self._head[p] == slot, f"slot {slot} is not in eviction list {p}"
            self._head[p] = nxt
        else:
            self._next[prv] = nxt
        if nxt == NO_SLOT:
            self._tail[p] = prv
        else:
            self._prev[nxt] = prv
        if self._head[p] == NO_SLOT:
            self._nonempty &= ~(1 << p)
        self._prev[slot] = self._next[slot] = NO_SLOT
        self._len -= 1

    def remove_many(self, slots: list[int]) -> None:
        """``remove`` of each of ``slots`` (one pass, no call per slot)."""
        prev, next_, prio, heads, tails = self._prev, self._next, self._prio, self._head, self._tail
        for slot in slots:
            p = prio[slot]
            prv, nxt = prev[slot], next_[slot]
            if prv == NO_SLOT:
                assert heads[p] == slot, f"slot {slot} is not in eviction list {p}"
                heads[p] = nxt
                if nxt == NO_SLOT:
                    self._nonempty &= ~(1 << p)
            else:
                next_[prv] = nxt
            if nxt == NO_SLOT:
                tails[p] = prv
            else:
                prev[nxt] = prv
            prev[slot] = next_[slot] = NO_SLOT
        self._len -= len(slots)

    def pop_victims(self, n: int) -> list[int]:
        """``pop_victim`` ``n`` times (fewer when the lists run out), walking each list
        from its head and cutting it once."""
        out: list[int] = []
        prev, next_, heads, tails = self._prev, self._next, self._head, self._tail
        while len(out) < n and self._nonempty:
            m = self._nonempty
            p = (m & -m).bit_length() - 1
            slot = heads[p]
            while slot != NO_SLOT and len(out) < n:
                out.append(slot)
                nxt = next_[slot]
                prev[slot] = next_[slot] = NO_SLOT
                slot = nxt
            heads[p] = slot
            if slot == NO_SLOT:
                tails[p] = NO_SLOT
                self._nonempty = m & ~(1 << p)
            else:
                prev[slot] = NO_SLOT
        self._len -= len(out)
        return out

    def pop_victim(self) -> int:
        """Remove and return the next slot to evict, or NO_SLOT when empty. The victim
        is a list head, so only its successor's back link changes."""
        m = self._nonempty
        if not m:
            return NO_SLOT
        p = (m & -m).bit_length() - 1
        slot = self._head[p]
        nxt = self._next[slot]
        self._head[p] = nxt
        if nxt == NO_SLOT:
            self._tail[p] = NO_SLOT
            self._nonempty = m & ~(1 << p)
        else:
            self._prev[nxt] = NO_SLOT
            self._next[slot] = NO_SLOT
        self._len -= 1
        return slot

    def __iter__(self) -> Iterator[int]:
        """Slots in eviction order (O(n); for tests and invariant checks)."""
        for p in range(NUM_PRIORITIES):
            s = self._head[p]
            while s != NO_SLOT:
                yield s
                s = self._next[s]

    def check_invariants(self) -> None:
        count = 0
        for p in range(NUM_PRIORITIES):
            s, prev = self._head[p], NO_SLOT
            assert bool(self._nonempty >> p & 1) == (s != NO_SLOT), f"bitmask wrong at priority {p}"
            while s != NO_SLOT:
                assert self._prio[s] == p, f"slot {s} of priority {self._prio[s]} in list {p}"
                assert self._prev[s] == prev, f"broken back link at slot {s}"
                prev, s = s, self._next[s]
                count += 1
                assert count <= self._len, "cycle in an eviction list"
            assert self._tail[p] == prev, f"tail of list {p} is {self._tail[p]}, expected {prev}"
        assert count == self._len, f"eviction lists hold {count} slots, length says {self._len}"
