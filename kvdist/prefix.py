"""Chained block hashes and the compact prefix index.

A full block's hash is ``xxh3_128(parent_digest || token_ids as int32)``; the first
block's parent is a salt derived from the model geometry, so caches of different
shapes never share a hash. 128 bits keep the chance that a lookup of a never-seen
prefix hits a stored block at about n / 2**128 — far below one in the lifetime of any
deployment (64 bits would give one false hit per ~1e12 lookups at 16M blocks).

The index is an open-addressing table of int32 slot ids with linear probing and
backward-shift deletion (no tombstones, so probe lengths stay short under churn).
Keys are not stored in the table: the slot's hash lives in :class:`BlockMeta`, which
costs the index 4 bytes per table entry. The table is the smallest power of two that
keeps the load at most 0.6 when every slot is indexed (a miss then probes 3.6 entries
on average, a hit 1.75): 6.7–13.3 bytes per block."""

from __future__ import annotations

from array import array

import numpy as np
import xxhash

from .blocks import NO_SLOT, BlockMeta

MASK64 = (1 << 64) - 1
_hash128 = xxhash.xxh3_128_intdigest


def token_bytes(tokens) -> memoryview:
    """Token ids as little-endian int32 bytes (the hash input)."""
    try:
        return memoryview(array("i", tokens)).cast("B")
    except OverflowError:
        raise ValueError("token ids must fit in int32") from None


def chain_hashes(parent: bytes, tok: memoryview, first_block: int, n_blocks: int,
                 tokens_per_block: int) -> list[int]:
    """Hashes (128-bit ints) of blocks ``first_block .. first_block+n_blocks-1`` of a
    token stream, chained from ``parent`` (the digest of the block before)."""
    stride = 4 * tokens_per_block
    out = []
    off = first_block * stride
    for _ in range(n_blocks):
        h = _hash128(parent + tok[off : off + stride])
        out.append(h)
        parent = h.to_bytes(16, "little")
        off += stride
    return out


def digest_bytes(h: int) -> bytes:
    return h.to_bytes(16, "little")


def split(h: int) -> tuple[int, int]:
    """(hi, lo) 64-bit halves of a 128-bit hash."""
    return h >> 64, h & MASK64


class PrefixIndex:
    """Hash → slot map over the slots of every tier. Each hash lives in at most one slot."""

    def __init__(self, capacity: int, meta: BlockMeta):
        size = 16
        while 3 * size < 5 * capacity:  # load = capacity / size <= 0.6
            size *= 2
        self._table = np.full(size, NO_SLOT, dtype=np.int32)
        self._t = memoryview(self._table)
        self._mask = size - 1
        self._hi = meta.hi_mv
        self._lo = meta.lo_mv
        self._len = 0

    def __len__(self) -> int:
        return self._len

    @property
    def nbytes(self) -> int:
        return self._table.nbytes

    def _probe(self, hi: int, lo: int) -> tuple[int, int]:
        """(position, slot) of the key, or (first empty position, NO_SLOT)."""
        t, mask, his, los = self._t, self._mask, self._hi, self._lo
        i = lo & mask
        while True:
            s = t[i]
            if s == NO_SLOT or (los[s] == lo and his[s] == hi):
                return i, s
            i = (i + 1) & mask

    def find(self, h: int) -> int:
        """Slot holding the block with hash ``h``, or NO_SLOT."""
        return self._probe(h >> 64, h & MASK64)[1]

    def match(self, hashes: list[int]) -> list[int]:
        """Slots of the longest run of leading ``hashes`` that are indexed (the prefix
        lookup of a prompt; the probe loop is inlined, it runs once per prompt block)."""
        t, mask, his, los = self._t, self._mask, self._hi, self._lo
        out: list[int] = []
        for h in hashes:
            hi, lo = h >> 64, h & MASK64
            i = lo & mask
            while True:
                s = t[i]
                if s == NO_SLOT:
                    return out
                if los[s] == lo and his[s] == hi:
                    break
                i = (i + 1) & mask
            out.append(s)
        return out

    def insert(self, slot: int) -> bool:
        """Index ``slot`` under the hash stored in meta. False if that hash is already
        indexed (another slot holds the same block); nothing changes then."""
        t, mask, his, los = self._t, self._mask, self._hi, self._lo
        hi, lo = his[slot], los[slot]
        i = lo & mask
        while True:
            s = t[i]
            if s == NO_SLOT:
                break
            if los[s] == lo and his[s] == hi:
                return False
            i = (i + 1) & mask
        assert self._len < self._mask, "prefix index full"
        t[i] = slot
        self._len += 1
        return True

    def _position(self, slot: int) -> int:
        """Table position of ``slot`` (which must be indexed). Slots are unique in the
        table, so the probe compares slot ids, not keys."""
        t, mask = self._t, self._mask
        i = self._lo[slot] & mask
        while True:
            s = t[i]
            if s == slot:
                return i
            assert s != NO_SLOT, f"slot {slot} is not indexed under its hash"
            i = (i + 1) & mask

    def retarget_many(self, olds: list[int], news: list[int]) -> None:
        """``retarget`` for each pair (the probe inlined: once per block moved)."""
        t, mask, lo = self._t, self._mask, self._lo
        for old, new in zip(olds, news):
            i = lo[old] & mask
            while True:
                s = t[i]
                if s == old:
                    break
                assert s != NO_SLOT, f"slot {old} is not indexed under its hash"
                i = (i + 1) & mask
            t[i] = new

    def retarget(self, old: int, new: int) -> None:
        """The block of slot ``old`` now lives in slot ``new`` (meta already copied)."""
        self._t[self._position(old)] = new

    def remove(self, slot: int) -> None:
        """Drop ``slot``'s entry; backward-shift the cluster behind it."""
        t, mask, lo = self._t, self._mask, self._lo
        i = self._position(slot)
        j = i
        while True:
            j = (j + 1) & mask
            s = t[j]
            if s == NO_SLOT:
                break
            # Move s back into the hole at i unless its home lies cyclically in (i, j]:
            # the distance from home to j must be at least the distance from i to j.
            if (j - (lo[s] & mask)) & mask >= (j - i) & mask:
                t[i] = s
                i = j
        t[i] = NO_SLOT
        self._len -= 1

    def slots(self) -> np.ndarray:
        return self._table[self._table != NO_SLOT]

    def check_invariants(self) -> None:
        occupied = self.slots()
        assert len(occupied) == self._len, f"index holds {len(occupied)}, length says {self._len}"
        assert len(np.unique(occupied)) == len(occupied), "a slot is indexed twice"
        for s in occupied.tolist():
            # Found by its key (so no earlier slot holds the same hash), and no empty
            # entry between its home and its position.
            assert self._probe(self._hi[s], self._lo[s])[1] == s, f"slot {s} unreachable by its hash"
