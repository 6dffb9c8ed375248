"""The directory: which other replica holds which block in its host tier (rule R4).

Each replica's ranks keep a *mirror* of every peer replica's host tier: per peer host
slot, the hash of the block it holds (or nothing). Peers send their changes as
records — ``(slot, held, hash)``, one per host slot whose block changed in a step —
and a replica applies them at step boundaries, in an order its TP ranks agree on
(``kvdist.distributed.remote``), so their mirrors are always equal. A mirror may be
stale (the peer changed the slot since): fetches check the slot's stamp (R2).

Lookups go through an open-addressing table of mirror entries keyed by the low 64
bits of the hash (the high half is checked against the mirror); several peers may
hold one block (a system prompt every replica holds): a lookup takes the first found.
Every replica applies every peer's changes, so applying must cost next to nothing
per record: all records of a step are applied at once, with numpy (entries leave
the table as tombstones, rebuilt away when they pile up). Memory per peer host slot:
17 bytes of mirror and 8–16 of table (int32 entries at load <= 0.5)."""

from __future__ import annotations

import numpy as np
import xxhash

from ..prefix import MASK64

# One directory record: a peer's host slot, whether it holds a block, and the block's hash.
RECORD = np.dtype([("slot", "<i4"), ("held", "<i4"), ("hi", "<u8"), ("lo", "<u8")])


def encode(slots: np.ndarray, held: np.ndarray, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Records for a message (see RECORD)."""
    rec = np.empty(len(slots), dtype=RECORD)
    rec["slot"], rec["held"], rec["hi"], rec["lo"] = slots, held, hi, lo
    return rec


EMPTY, TOMB = -1, -2


class HolderTable:
    """Open addressing (linear probing) over mirror entries, keyed by ``lo[g]``; a
    deleted entry becomes a tombstone. Inserts and deletes take arrays of entries and
    run as a few numpy operations per probe round; ``find`` probes in Python (one
    lookup per prompt block, on the fetcher's own path)."""

    def __init__(self, capacity: int, hi: np.ndarray, lo: np.ndarray):
        size = 16
        while size < 2 * capacity:
            size *= 2
        self.table = np.full(size, EMPTY, dtype=np.int32)
        self._t = memoryview(self.table)
        self.mask = size - 1
        self.hi, self.lo = hi, lo
        self._hi, self._lo = memoryview(hi), memoryview(lo)
        self.live = 0
        self.tombs = 0

    def _home(self, gs: np.ndarray) -> np.ndarray:
        return (self.lo[gs] & np.uint64(self.mask)).astype(np.int64)

    def insert(self, gs: np.ndarray) -> None:
        """Add entries ``gs`` (distinct, not in the table), in order: at a position
        two of them probe at once, the earlier one wins."""
        t, mask = self.table, self.mask
        pos, left = self._home(gs), np.arange(len(gs))
        placed = np.zeros(len(gs), dtype=bool)
        while len(left):
            p = pos[left]
            free = t[p] < 0
            if free.any():
                claim, at = left[free], p[free]
                _, first = np.unique(at, return_index=True)  # the earliest claim of each position
                won = claim[first]
                self.tombs -= int((t[at[first]] == TOMB).sum())
                t[at[first]] = gs[won]
                placed[won] = True
                left = left[~placed[left]]
            pos[left] = (pos[left] + 1) & mask
        self.live += len(gs)
        assert self.live + self.tombs <= self.mask, "directory table full"

    def delete(self, gs: np.ndarray) -> None:
        """Remove entries ``gs`` (each in the table once)."""
        t, mask = self.table, self.mask
        pos, left = self._home(gs), np.arange(len(gs))
        while len(left):
            p = pos[left]
            hit = t[p] == gs[left]
            t[p[hit]] = TOMB
            left = left[~hit]
            pos[left] = (pos[left] + 1) & mask
        self.live -= len(gs)
        self.tombs += len(gs)
        if self.tombs > (self.mask + 1) // 4:  # probes would grow: rebuild without them
            live = self.table[self.table >= 0].copy()
            self.table[:] = EMPTY
            self.live = self.tombs = 0
            self.insert(live)

    def find(self, hi: int, lo: int) -> int:
        """The first entry holding hash (hi, lo), or EMPTY."""
        t, mask, his, los = self._t, self.mask, self._hi, self._lo
        i = lo & mask
        while True:
            g = t[i]
            if g == EMPTY:
                return EMPTY
            if g >= 0 and los[g] == lo and his[g] == hi:
                return g
            i = (i + 1) & mask

    def entries(self) -> np.ndarray:
        return self.table[self.table >= 0]

    def check_invariants(self) -> None:
        t = self.table
        assert (t >= 0).sum() == self.live and (t == TOMB).sum() == self.tombs, "table counts"
        live = t[t >= 0]
        assert len(np.unique(live)) == len(live), "an entry is in the table twice"
        for pos in np.flatnonzero(t >= 0).tolist():
            i = int(self.lo[t[pos]]) & self.mask  # no empty position between home and entry
            while i != pos:
                assert t[i] != EMPTY, f"entry {t[pos]} unreachable from its home"
                i = (i + 1) & self.mask


class Directory:
    """The mirror of every peer replica's host tier (``host_slots`` slots each) for
    replica ``me`` of ``num_replicas``. Entry ``g = peer * host_slots + slot``."""

    def __init__(self, num_replicas: int, me: int, host_slots: int):
        self.num_replicas, self.me, self.host_slots = num_replicas, me, host_slots
        n = num_replicas * host_slots
        self.hi = np.zeros(n, dtype=np.uint64)
        self.lo = np.zeros(n, dtype=np.uint64)
        self.held = np.zeros(n, dtype=bool)
        self.table = HolderTable(max((num_replicas - 1) * host_slots, 1), self.hi, self.lo)
        self.records_applied = 0

    @property
    def nbytes(self) -> int:
        return self.hi.nbytes + self.lo.nbytes + self.held.nbytes + self.table.table.nbytes

    def __len__(self) -> int:
        """Blocks the peers hold (one per holder), as far as this mirror knows."""
        return self.table.live

    def apply(self, messages: list[tuple[int, np.ndarray]]) -> None:
        """Apply ``(peer, records)`` messages, in the order given (each peer's in the
        order it sent them), all at once: where one slot changed twice, the last record
        stands."""
        if not messages:
            return
        for peer, _ in messages:
            assert peer != self.me and 0 <= peer < self.num_replicas, f"bad peer {peer}"
        rec = np.concatenate([r for _, r in messages])
        slots, held, hi, lo = (rec["slot"].astype(np.int64), rec["held"] != 0, rec["hi"], rec["lo"])
        assert ((slots >= 0) & (slots < self.host_slots)).all(), "a record names a slot out of range"
        peers = np.concatenate([np.full(len(r), peer, dtype=np.int64) for peer, r in messages])
        g = peers * self.host_slots + slots
        _, last = np.unique(g[::-1], return_index=True)
        keep = np.sort(len(g) - 1 - last)  # the last record of each slot, in message order
        g, held = g[keep], held[keep]
        gone = g[self.held[g]]
        if len(gone):
            self.table.delete(gone)
        self.held[g] = held
        self.hi[g] = np.where(held, hi[keep], 0)
        self.lo[g] = np.where(held, lo[keep], 0)
        if held.any():
            self.table.insert(g[held])
        self.records_applied += len(slots)

    def match(self, hashes: list[int]) -> list[int]:
        """Entries of the longest run of leading ``hashes`` some peer holds."""
        find = self.table.find
        out = []
        for h in hashes:
            g = find(h >> 64, h & MASK64)
            if g < 0:
                break
            out.append(g)
        return out

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
        return h.digest()

    def check_invariants(self) -> None:
        self.table.check_invariants()
        mine = slice(self.me * self.host_slots, (self.me + 1) * self.host_slots)
        assert not self.held[mine].any(), "the mirror holds this replica's own slots"
        assert np.array_equal(np.sort(self.table.entries()), np.flatnonzero(self.held)), \
            "table entries != held mirror slots"
