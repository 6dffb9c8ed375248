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

__all__ = ["MASK64", "PrefixIndex", "chain_digests", "chain_hashes", "digest_bytes", "digests_to_ints",
           "split", "token_bytes"]

MASK64 = (1 << 64) - 1
_digest128 = xxhash.xxh3_128_digest  # big-endian bytes: int.from_bytes(d, "big") is the intdigest

# Fewer keys than this go through the index one by one: a round of a vectorized probe
# costs a few numpy calls (some µs) whatever the keys; the keys still probing after
# a round (a long cluster's) finish one by one once fewer than this are left.
VECTOR_FROM = 32


def token_bytes(tokens) -> memoryview:
    """Token ids as little-endian int32 bytes (the hash input)."""
    try:
        return memoryview(array("i", tokens)).cast("B")
    except OverflowError:
        raise ValueError("token ids must fit in int32") from None


def _chain(parent: bytes, tok, first_block: int, n_blocks: int, tokens_per_block: int) -> list[bytes]:
    """The little-endian 16-byte digests of the blocks (see ``chain_hashes``): one
    xxh3 call a block on a slice of one bytes copy of the tokens, the parent reversed
    from the canonical (big-endian) digest, no int built per block."""
    stride = 4 * tokens_per_block
    start = first_block * stride
    data = bytes(tok[start: start + n_blocks * stride])
    out: list[bytes] = []
    append, h = out.append, _digest128
    for off in range(0, n_blocks * stride, stride):
        parent = h(parent + data[off: off + stride])[::-1]
        append(parent)
    return out


def chain_hashes(parent: bytes, tok: memoryview, first_block: int, n_blocks: int,
                 tokens_per_block: int) -> list[int]:
    """Hashes (128-bit ints) of blocks ``first_block .. first_block+n_blocks-1`` of a
    token stream, chained from ``parent`` (the digest of the block before)."""
    return [int.from_bytes(d, "little") for d in _chain(parent, tok, first_block, n_blocks, tokens_per_block)]


def chain_digests(parent: bytes, tok: memoryview, first_block: int, n_blocks: int,
                  tokens_per_block: int) -> np.ndarray:
    """``chain_hashes`` as a ``[n_blocks, 2]`` uint64 array: row i holds block i's hash
    as (low, high) 64-bit halves (its ``digest_bytes`` read as two little-endian words);
    ``digest_bytes`` of the last block is its last row's ``tobytes()``."""
    d = _chain(parent, tok, first_block, n_blocks, tokens_per_block)
    return np.frombuffer(b"".join(d), dtype="<u8").reshape(n_blocks, 2)


def digests_to_ints(d: np.ndarray) -> list[int]:
    """The 128-bit ints of ``chain_digests`` rows."""
    b = np.ascontiguousarray(d, dtype="<u8").tobytes()
    return [int.from_bytes(b[i: i + 16], "little") for i in range(0, len(b), 16)]


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
        self._hi_a, self._lo_a = meta.hash_hi, meta.hash_lo  # the same, for vectorized probes
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

    def match_digests(self, d: np.ndarray) -> np.ndarray:
        """``match`` of ``chain_digests`` rows: the int64 slots of the longest run of
        leading rows indexed. Every key probes at once, one step of its probe sequence
        a round (a round costs a few numpy calls over the keys still probing)."""
        n = len(d)
        if n < VECTOR_FROM:
            return np.asarray(self.match(digests_to_ints(d)), dtype=np.int64)
        t, mask = self._table, self._mask
        lo, hi = d[:, 0], d[:, 1]
        found = np.full(n, NO_SLOT, dtype=np.int64)
        pos = (lo & np.uint64(mask)).astype(np.int64)
        todo = np.arange(n)
        while len(todo) >= VECTOR_FROM:
            s = t[pos[todo]].astype(np.int64)
            full = s != NO_SLOT
            hit = full & (self._lo_a[s] == lo[todo]) & (self._hi_a[s] == hi[todo])
            found[todo[hit]] = s[hit]
            miss = todo[~full]
            todo = todo[full & ~hit]
            if len(miss):  # rows past the first miss cannot be in the run
                todo = todo[todo < miss[0]]
            pos[todo] = (pos[todo] + 1) & mask
        tm, los, his = self._t, self._lo, self._hi
        for r in todo.tolist():  # the few left, in order, from where they stopped
            i, key_lo, key_hi = int(pos[r]), int(lo[r]), int(hi[r])
            while (s := tm[i]) != NO_SLOT and not (los[s] == key_lo and his[s] == key_hi):
                i = (i + 1) & mask
            if s == NO_SLOT:
                break  # the run ends at row r
            found[r] = s
        out = np.flatnonzero(found == NO_SLOT)
        return found[: out[0] if len(out) else n]

    def _positions(self, slots: np.ndarray) -> np.ndarray:
        """Table positions of indexed ``slots`` (distinct), probed all at once."""
        t, mask = self._table, self._mask
        pos = (self._lo_a[slots] & np.uint64(mask)).astype(np.int64)
        todo = np.flatnonzero(t[pos] != slots)
        while len(todo) >= VECTOR_FROM:
            assert (t[pos[todo]] != NO_SLOT).all(), "a slot is not indexed under its hash"
            pos[todo] = (pos[todo] + 1) & mask
            todo = todo[t[pos[todo]] != slots[todo]]
        for r in todo.tolist():  # the few left, one by one
            pos[r] = self._position(int(slots[r]))
        return pos

    def insert_many(self, slots: np.ndarray) -> np.ndarray:
        """``insert`` of each of ``slots`` (distinct), in order: whether each was indexed
        (False: its hash was indexed already, by another slot or an earlier one of
        ``slots``). All probe at once; at an empty entry the earliest candidate wins and
        the others look at it again in the next round. Entries may sit elsewhere than
        one-by-one inserts would put them, but every probe sequence stays unbroken, so
        the table holds the same keys with the same slots."""
        slots = np.asarray(slots, dtype=np.int64)
        n = len(slots)
        if n < VECTOR_FROM:
            return np.fromiter((self.insert(s) for s in slots.tolist()), dtype=bool, count=n)
        t, mask, los, his = self._table, self._mask, self._lo_a, self._hi_a
        lo, hi = los[slots], his[slots]
        pos = (lo & np.uint64(mask)).astype(np.int64)
        indexed = np.zeros(n, dtype=bool)
        todo = np.arange(n)
        while len(todo) >= VECTOR_FROM:
            p = pos[todo]
            s = t[p].astype(np.int64)
            empty = s == NO_SLOT
            same = ~empty & (los[s] == lo[todo]) & (his[s] == hi[todo])  # a duplicate: done
            at, first = np.unique(p[empty], return_index=True)  # todo is ascending: the earliest wins
            won = todo[empty][first]
            assert self._len + len(won) <= self._mask, "prefix index full"
            t[at] = slots[won]
            self._len += len(won)
            indexed[won] = True
            go = ~empty & ~same  # occupied by another key: one step on; losers stay to look again
            pos[todo[go]] = (p[go] + 1) & mask
            keep = ~same
            keep[np.flatnonzero(empty)[first]] = False
            todo = todo[keep]
        for r in todo.tolist():  # the few left, in order (an earlier one of a key wins)
            indexed[r] = self.insert(int(slots[r]))
        return indexed

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
        """``retarget`` for each pair (``olds`` distinct): probed all at once from
        ``VECTOR_FROM`` pairs, else one by one with the probe inlined."""
        if len(olds) >= VECTOR_FROM:
            self._table[self._positions(np.asarray(olds, dtype=np.int64))] = news
            return
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
