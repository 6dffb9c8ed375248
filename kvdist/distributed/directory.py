"""The directory: which other replica holds which block in its host tier (rule R4).

Each replica's ranks keep a *mirror* of the host tier of every peer replica that is
not a node peer (those are looked up in ``node_directory``'s file): per peer host
slot, the hash of the block it holds (or nothing). Peers send their changes as
records — ``(slot, held, hash)``, one per host slot whose block changed since their
last message — and a replica applies them at step boundaries, in an order its TP ranks agree on
(``kvdist.distributed.remote``), so their mirrors are always equal. A mirror may be
stale (the peer changed the slot since): fetches check the slot's stamp (R2).

Lookups go through a table of buckets of mirror entries keyed by the low 64 bits of
the hash (the high half is checked against the mirror); several peers may hold one
block (a system prompt every replica holds): a lookup takes the first found. Every
replica applies every peer's changes, so applying must cost next to nothing per
record: all records that arrived are applied at once, in a fixed number of numpy
operations whatever their number (``HolderTable``). Memory per mirrored peer host slot: 17
bytes of mirror, 4 of position and 8-16 of table (int32 entries, buckets at most half
full)."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import xxhash

from ..prefix import MASK64

# One directory record: a row of three uint64 — a peer's host slot times two, plus one
# if it holds a block; the block's hash, high and low half (zero when it holds none).
RECORD_WORDS = 3


def encode(slots: np.ndarray, held: np.ndarray, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Records for a message: uint64 ``[len(slots), 3]`` (see RECORD_WORDS)."""
    rec = np.empty((len(slots), RECORD_WORDS), dtype=np.uint64)
    rec[:, 0] = np.asarray(slots, dtype=np.uint64) * np.uint64(2) + (np.asarray(held) != 0)
    rec[:, 1], rec[:, 2] = hi, lo
    return rec


EMPTY, SPILLED = -1, -2
WAYS = 16  # entries per bucket: a lookup reads one bucket (a spill list after it, rarely)


def table_buckets(capacity: int) -> int:
    """Buckets of a ``HolderTable`` for ``capacity`` entries: a power of two, at most
    half full on average."""
    buckets = 1
    while buckets * WAYS < 2 * capacity:
        buckets *= 2
    return buckets


class HolderTable:
    """Buckets of ``WAYS`` entries (int32 mirror entries, EMPTY where none), a bucket
    per ``lo[g] & mask``, at most half full on average; the rare entry whose bucket is
    full goes to ``spill`` (a dict bucket -> entries, looked in after the bucket).
    ``at[g]`` is where entry ``g`` sits (SPILLED or EMPTY if not in a bucket). Inserts
    and deletes take arrays of entries and are a handful of numpy operations whatever
    their number (an insert takes one more round per extra entry that falls into one
    bucket); ``find`` reads one bucket in Python (one lookup per prompt block, on the
    fetcher's own path)."""

    def __init__(self, capacity: int, hi: np.ndarray, lo: np.ndarray):
        buckets = table_buckets(capacity)
        self.table = np.full((buckets, WAYS), EMPTY, dtype=np.int32)
        self.flat = self.table.reshape(-1)
        self._t = memoryview(self.flat)
        self.at = np.full(len(hi), EMPTY, dtype=np.int32)
        self.mask = buckets - 1
        self.hi, self.lo = hi, lo
        self._hi, self._lo = memoryview(hi), memoryview(lo)
        self.spill: dict[int, list[int]] = {}
        self.live = 0

    def _bucket(self, gs: np.ndarray) -> np.ndarray:
        return (self.lo[gs] & np.uint64(self.mask)).astype(np.intp)

    def insert(self, gs: np.ndarray) -> None:
        """Add entries ``gs`` (distinct, not in the table). Each round puts every entry
        left in its bucket's first free way; where several entries of the round chose
        one way, the last one (in ``gs`` order) takes it and the others go on to the
        next round: as many rounds as entries share a bucket, usually two or three.
        Deterministic, so the TP ranks of a replica build the same table."""
        gs = np.asarray(gs, dtype=np.int64)
        self.live += len(gs)
        b = self._bucket(gs)
        flat = self.flat
        while len(gs):
            free = self.table[b] == EMPTY
            way = free.argmax(axis=1)
            fits = free[np.arange(len(b)), way]
            if not fits.all():
                for bucket, g in zip(b[~fits].tolist(), gs[~fits].tolist()):
                    self.spill.setdefault(bucket, []).append(g)
                    self.at[g] = SPILLED
                b, gs, way = b[fits], gs[fits], way[fits]
            pos = b * WAYS + way
            flat[pos] = gs  # with repeated positions, numpy's last assignment stands
            won = flat[pos] == gs
            self.at[gs[won]] = pos[won]
            b, gs = b[~won], gs[~won]

    def delete(self, gs: np.ndarray) -> None:
        """Remove entries ``gs`` (each in the table once)."""
        if len(gs) == 0:
            return
        pos = self.at[gs]
        self.flat[pos[pos >= 0]] = EMPTY
        self.at[gs] = EMPTY
        if self.spill:
            for g in gs[pos == SPILLED].tolist():
                bucket = int(self.lo[g]) & self.mask
                spilled = self.spill[bucket]
                spilled.remove(g)
                if not spilled:
                    del self.spill[bucket]
        self.live -= len(gs)

    def find(self, hi: int, lo: int) -> int:
        """The first entry holding hash (hi, lo), or EMPTY."""
        t, his, los = self._t, self._hi, self._lo
        bucket = lo & self.mask
        at = bucket * WAYS
        for g in t[at:at + WAYS]:
            if g >= 0 and los[g] == lo and his[g] == hi:
                return g
        if self.spill:
            for g in self.spill.get(bucket, ()):
                if los[g] == lo and his[g] == hi:
                    return g
        return EMPTY

    def entries(self) -> np.ndarray:
        spilled = [g for gs in self.spill.values() for g in gs]
        return np.concatenate([self.flat[self.flat >= 0], np.array(spilled, dtype=np.int32)])

    def check_invariants(self) -> None:
        live = self.entries()
        assert len(live) == self.live, "table count"
        assert len(np.unique(live)) == len(live), "an entry is in the table twice"
        pos = np.flatnonzero(self.flat >= 0)
        assert np.array_equal(self.at[self.flat[pos]], pos), "an entry's position is wrong"
        assert np.array_equal(self._bucket(self.flat[pos]), pos // WAYS), "an entry outside its bucket"
        spilled = live[len(pos):]
        assert (self.at[spilled] == SPILLED).all(), "a spilled entry's position is wrong"
        assert (self.at >= 0).sum() + len(spilled) == self.live, "positions of entries not in the table"
        for bucket, gs in self.spill.items():
            assert all(int(self.lo[g]) & self.mask == bucket for g in gs), "a spilled entry of another bucket"


class NodeLookup(Protocol):
    """The node directory as lookups see it (``kvdist.distributed.node_directory``)."""

    epochs: np.ndarray  # the node peers' epochs this rank reads at (in the digest)

    def find(self, hi: int, lo: int) -> int: ...
    def listed(self) -> int: ...
    def known(self) -> int: ...


class Directory:
    """What replica ``me`` of ``num_replicas`` knows of the other replicas' host tiers
    (``host_slots`` slots each); a directory entry is ``g = peer * host_slots + slot``.
    The peers on this node (``node``, when there are any) send no records: their
    blocks are looked up in the node directory, first. The others' (``mirrored``, by
    default every other replica) are kept in a mirror of their host tiers, in their
    order: mirror entry ``m = i * host_slots + slot`` for ``mirrored[i]``."""

    def __init__(self, num_replicas: int, me: int, host_slots: int, node: NodeLookup | None = None,
                 mirrored: tuple[int, ...] | None = None):
        self.num_replicas, self.me, self.host_slots = num_replicas, me, host_slots
        self.node = node
        self.mirrored = tuple(p for p in range(num_replicas) if p != me) if mirrored is None else mirrored
        assert me not in self.mirrored, "a replica mirrors its own host tier"
        self._index = np.full(num_replicas, -1, dtype=np.int64)  # peer -> its place in the mirror
        self._index[list(self.mirrored)] = np.arange(len(self.mirrored))
        n = len(self.mirrored) * host_slots
        self.hi = np.zeros(n, dtype=np.uint64)
        self.lo = np.zeros(n, dtype=np.uint64)
        self.held = np.zeros(n, dtype=bool)
        self.table = HolderTable(max(n, 1), self.hi, self.lo)
        self.records_applied = 0

    @property
    def nbytes(self) -> int:
        t = self.table
        return self.hi.nbytes + self.lo.nbytes + self.held.nbytes + t.table.nbytes + t.at.nbytes

    @staticmethod
    def sized(mirrored: int, host_slots: int) -> int:
        """``nbytes`` of a directory mirroring ``mirrored`` peers of ``host_slots`` slots,
        without building it (for figures at a scale no test runs)."""
        n = mirrored * host_slots
        entry = 2 * np.dtype(np.uint64).itemsize + np.dtype(bool).itemsize + np.dtype(np.int32).itemsize
        return n * entry + table_buckets(max(n, 1)) * WAYS * np.dtype(np.int32).itemsize

    def __len__(self) -> int:
        """Blocks the peers hold (one per holder), as far as this rank's lookups see
        (the node directory's part counted entry by entry: for tests)."""
        return self.table.live + (self.node.listed() if self.node is not None else 0)

    def known(self) -> int:
        """Blocks the peers hold, as the mirror and the node peers' latest entries say
        (cheap: for stats)."""
        return self.table.live + (self.node.known() if self.node is not None else 0)

    def apply(self, messages: list[tuple[int, np.ndarray]]) -> None:
        """Apply ``(peer, records)`` messages, in the order given (each peer's in the
        order it sent them), all at once: where one slot changed twice, the last record
        stands."""
        if not messages:
            return
        peers = [peer for peer, _ in messages]
        assert 0 <= min(peers) and max(peers) < self.num_replicas and (self._index[peers] >= 0).all(), \
            f"records of peers {peers}, mirrored {self.mirrored}"
        rec = messages[0][1] if len(messages) == 1 else np.concatenate([r for _, r in messages])
        slots = (rec[:, 0] >> np.uint64(1)).astype(np.int64)
        assert len(slots) == 0 or slots.max() < self.host_slots, "a record names a slot out of range"
        bases = self._index[peers] * self.host_slots
        g = slots + np.repeat(bases, [len(r) for _, r in messages])
        held, hi, lo = (rec[:, 0] & np.uint64(1)).astype(bool), rec[:, 1], rec[:, 2]
        if len(set(peers)) < len(peers):  # a peer's slot may be in two messages: the last stands
            _, last = np.unique(g[::-1], return_index=True)
            keep = np.sort(len(g) - 1 - last)  # the last record of each slot, in message order
            g, held, hi, lo = g[keep], held[keep], hi[keep], lo[keep]
        self.table.delete(g[self.held[g]])
        self.held[g] = held
        self.hi[g] = hi * held
        self.lo[g] = lo * held
        self.table.insert(g[held])
        self.records_applied += len(slots)

    def match(self, hashes: list[int]) -> list[int]:
        """Entries of the longest run of leading ``hashes`` some peer holds."""
        out = []
        for h in hashes:
            g = self.find(h)
            if g < 0:
                break
            out.append(g)
        return out

    def find(self, h: int) -> int:
        """The entry of a peer holding the block of hash ``h`` (a node peer's first),
        EMPTY if none is listed."""
        hi, lo = h >> 64, h & MASK64
        node = self.node
        g = node.find(hi, lo) if node is not None else EMPTY
        if g >= 0:
            return g
        table = self.table
        m = table.find(hi, lo) if table.live else EMPTY
        if m < 0:
            return EMPTY
        i, slot = divmod(m, self.host_slots)
        return self.mirrored[i] * self.host_slots + slot

    def holder(self, g: int) -> tuple[int, int]:
        """(peer replica, its host slot) of entry ``g``."""
        return divmod(g, self.host_slots)

    def digest(self) -> bytes:
        """xxh3-128 of what decides lookups (for consistency checks inside a replica)."""
        h = xxhash.xxh3_128()
        h.update(self.held.view(np.uint8))
        h.update(self.hi)
        h.update(self.lo)
        h.update(self.table.table)
        if self.node is not None:
            h.update(self.node.epochs)
        return h.digest()

    def check_invariants(self) -> None:
        self.table.check_invariants()
        assert np.array_equal(np.sort(self.table.entries()), np.flatnonzero(self.held)), \
            "table entries != held mirror slots"
