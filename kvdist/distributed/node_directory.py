"""The node directory: which replica on this node holds which block in its host tier,
in one shared-memory file per node that holders write and readers read, without
messages and without locks (docs/design.md, "Remote tier"; rules R2 and R4).

The replicas that have every rank on one node and their host tiers in shared memory
are *node peers* of each other (``remote_setup``); they find each other's blocks here.
Directory messages (``directory_channel``) go only to the other replicas.

The file (int32 words) holds, for node replica ``i`` (its index among the node's
replicas) of ``T`` TP ranks and host tiers of ``H`` slots:

```
published[i, t]         the epoch up to which TP rank t of replica i has stamped its slots
seen[j*T + t, i]        the epoch of replica i that TP rank t of replica j reads at
live[i]                 entries of replica i listed now (for stats)
fp, slot, born, died    the index: bucket b = (hash lo) & mask has, per replica, WAYS
  [bucket, i, way]      entries (32 bits of the hash, the host slot, the epochs between
                        which it is listed)
```

**Writer.** One rank per holder replica (its TP rank 0) writes that replica's entries;
no other process writes them, so nothing needs a lock. Every ``k`` steps, at end_step,
the replica moves to epoch e + 1: the entries of host slots that changed get
``died = e + 1``, new entries ``born = e + 1`` (``born`` written first, ``died`` last),
and then every TP rank of the holder, its stamps published, sets ``published[i, t]``.

**Readers.** A replica's TP ranks read replica ``i`` at an epoch ``E[i]`` they agreed on
(the MIN over the TP group of ``min_t published[i, t]``, riding on the remote tier's
agreement, R4). An entry is listed at ``E`` when ``born <= E < died``. The writer never
changes that answer for any ``E`` a reader may use: it only writes ``born``/``died``
values above every epoch it has published, and reuses an entry that died at ``d`` only
once every reader of replica ``i`` says (in ``seen``) that it reads at ``d`` or later.
So a lookup at ``E`` gives the same answer on every TP rank, whenever each makes it.
An entry whose block left the slot since is a stale miss at fetch time (R2), as a
record that a message brought late would be.

Costs: per node ``H`` x (node replicas) x 64 bytes (buckets at most a quarter full);
per host-slot change a handful of words written (at the boundary, vectorized); per
lookup one bucket row (``WAYS`` x node replicas words) searched for the fingerprint."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from ..storage.host import HostMemory

__all__ = ["NodeDirectory", "NodeShape"]

WAYS = 8
NEVER = 2**31 - 1  # ``died`` of a listed entry
EMPTY = -1


@dataclass(frozen=True, slots=True)
class NodeShape:
    """The file's geometry, equal on every rank of the node."""

    replicas: tuple[int, ...]  # global replica ids of the node's replicas, ascending
    tp_size: int
    host_slots: int

    @property
    def buckets(self) -> int:
        b = 1
        while b * WAYS < 4 * max(self.host_slots, 1):
            b *= 2
        return b

    @property
    def entries(self) -> int:
        return self.buckets * len(self.replicas) * WAYS

    @property
    def words(self) -> int:
        n, t = len(self.replicas), self.tp_size
        return n * t + n * t * n + n + 4 * self.entries

    @property
    def nbytes(self) -> int:
        return 4 * self.words


class NodeDirectory:
    """This rank's view of the node directory file ``path`` (created with ``create``,
    else mapped): replica ``replica``, TP rank ``tp_rank``; ``peers``: its node peers
    (global replica ids). TP rank 0 writes the replica's entries when it has peers."""

    def __init__(self, path: str, shape: NodeShape, replica: int, tp_rank: int,
                 peers: tuple[int, ...], create: bool = False):
        self.shape, self.replica, self.tp_rank, self.peers = shape, replica, tp_rank, peers
        self.path = path
        self._memory: HostMemory | None = HostMemory(shape.nbytes, shared_path=path, attach=not create,
                                                     huge_pages=False, progress=False, threads=1)
        words = self._memory.flat.numpy()[: shape.nbytes].view(np.int32)
        n, t, e = len(shape.replicas), shape.tp_size, shape.entries
        self.published = words[: n * t].reshape(n, t)
        at = n * t
        self.seen = words[at: at + n * t * n].reshape(n * t, n)
        at += n * t * n
        self.live = words[at: at + n]
        at += n
        self.fp, self.slot, self.born, self.died = (words[at + k * e: at + (k + 1) * e] for k in range(4))
        self.mask = shape.buckets - 1
        self.row = n * WAYS  # entries per bucket, all replicas
        self.me = shape.replicas.index(replica) if replica in shape.replicas else -1
        # Reader: the epoch of each node replica this rank reads at (0: nothing listed).
        self.epochs = np.zeros(n, dtype=np.int64)
        self._peer_idx = np.array([shape.replicas.index(p) for p in peers], dtype=np.intp)
        self._base = [r * shape.host_slots for r in shape.replicas]  # directory entry of slot 0
        self._e = memoryview(self.epochs)
        self._fp_bytes = memoryview(self.fp.view(np.uint8))
        self._slot, self._born, self._died = (memoryview(a) for a in (self.slot, self.born, self.died))
        self.held: np.ndarray | None = None  # tests: epochs frozen (a late publisher)
        # Writer (TP rank 0 with peers): where each host slot's listed entry is, which
        # ways are taken (listed, or dead but maybe still read), dead entries by epoch.
        self.writer = tp_rank == 0 and bool(peers)
        self.epoch = 0  # this replica's epoch (every TP rank counts it)
        if self.writer:
            self._pos = np.full(shape.host_slots, EMPTY, dtype=np.int64)
            self._owner = np.zeros(shape.buckets, dtype=np.intp)  # scratch: a round's entry per bucket
            self._taken = np.zeros((shape.buckets, WAYS), dtype=bool)
            self._dead: deque[tuple[int, np.ndarray]] = deque()
            self._readers = np.array([shape.replicas.index(p) * t + k for p in peers for k in range(t)],
                                     dtype=np.intp)
            self.unlisted = 0  # blocks not listed: their bucket's ways were all taken
            self._listed = 0

    # -- the holder's side ---------------------------------------------------------------------
    def advance(self, slots: np.ndarray, held: np.ndarray, hi: np.ndarray, lo: np.ndarray) -> None:
        """Epoch + 1 with these host slots' changes (local ids, each once; ``held``:
        it holds a block now, of hash ``hi``/``lo``). Called by every TP rank of the
        holder at the same boundaries, after its stamps are published; the writer
        writes the entries, every rank then says it published."""
        e = self.epoch = self.epoch + 1
        if self.writer:
            self._write(np.asarray(slots, dtype=np.int64), np.asarray(held, dtype=bool), hi, lo, e)
        self.published[self.me, self.tp_rank] = e

    def _write(self, slots: np.ndarray, held: np.ndarray, hi: np.ndarray, lo: np.ndarray, e: int) -> None:
        pos = self._pos
        old = pos[slots]
        old = old[old >= 0]
        if len(old):
            self.died[old] = e  # listed up to epoch e - 1
            self._dead.append((e, old))
            self._listed -= len(old)
        pos[slots] = EMPTY
        self._reclaim()
        if not held.all():
            slots, lo = slots[held], lo[held]
        lo = np.ascontiguousarray(lo, dtype=np.uint64)
        fps = lo.view(np.int32)[1::2]  # the high 32 bits of each lo (little-endian)
        b = (lo & np.uint64(self.mask)).astype(np.intp)
        ids = np.arange(len(b))
        owner, taken, me = self._owner, self._taken, self.me * WAYS
        while len(b):
            # A round: each entry takes its bucket's first free way, one entry a bucket
            # (where several share one, the last in order wins; the others go on to the
            # next round); an entry whose bucket has no free way is not listed.
            owner[b] = ids
            now = owner[b] == ids
            free = ~taken[b]
            way = free.argmax(axis=1)
            fits = free.any(axis=1)
            single = now.all()
            if not (single and fits.all()):
                self.unlisted += int((now & ~fits).sum())
                later = ~now
                now &= fits
                wb, way, ws = b[now], way[now], ids[now]
            else:
                wb, ws = b, ids
            taken[wb, way] = True
            at = wb * self.row + way + me
            self.born[at] = e  # first: until died is NEVER, the entry is listed at no epoch
            self.fp[at] = fps[ws]
            self.slot[at] = slots[ws]
            self.died[at] = NEVER
            pos[slots[ws]] = at
            self._listed += len(at)
            if single:
                break
            b, ids = b[later], ids[later]
        self.live[self.me] = self._listed

    def _reclaim(self) -> None:
        """Free the ways of entries that died at an epoch every reader has reached."""
        dead = self._dead
        if not dead:
            return
        horizon = int(self.seen[self._readers, self.me].min())
        while dead and dead[0][0] <= horizon:
            pos = dead.popleft()[1]
            self._taken[pos // self.row, pos % WAYS] = False

    # -- a reader's side ------------------------------------------------------------------------
    def observe(self, counts: np.ndarray) -> None:
        """Put into ``counts`` (per global replica) the epoch each node peer has
        published, for the TP group's agreement."""
        if len(self._peer_idx):
            now = self.published[self._peer_idx].min(axis=1) if self.held is None else self.held
            counts[list(self.peers)] = now

    def leave_to_others(self, counts: np.ndarray) -> None:
        """Put into ``counts`` the largest epoch for every node peer: this rank does not
        read the directory's epochs, the TP group's MIN takes another rank's."""
        if len(self._peer_idx):
            counts[list(self.peers)] = np.iinfo(counts.dtype).max

    def use(self, agreed: np.ndarray) -> None:
        """Read the node peers at the agreed epochs from now on, and say so."""
        if len(self._peer_idx):
            self.epochs[self._peer_idx] = agreed[list(self.peers)]
            self.seen[self.me * self.shape.tp_size + self.tp_rank] = self.epochs

    def find(self, hi: int, lo: int) -> int:
        """The directory entry (replica x host slots + slot) of the first node peer that
        lists hash (hi, lo) at the epochs this rank reads at, or -1."""
        start = (lo & self.mask) * self.row
        row = self._fp_bytes[4 * start: 4 * (start + self.row)].tobytes()
        key = ((lo >> 32) & 0xFFFFFFFF).to_bytes(4, "little")
        at = row.find(key)
        while at >= 0:
            if not at & 3:
                j = at >> 2
                k, e = start + j, self._e[j // WAYS]
                if self._died[k] > e and self._born[k] <= e:  # died first (see the docstring)
                    return self._base[j // WAYS] + self._slot[k]
            at = row.find(key, at + 1)
        return -1

    def listed(self) -> int:
        """Blocks the node peers list at the epochs this rank reads at (tests: O(file))."""
        e = np.broadcast_to(np.repeat(self.epochs, WAYS), (self.shape.buckets, self.row)).reshape(-1)
        return int(((self.born <= e) & (self.died > e)).sum())

    def known(self) -> int:
        """Blocks the node peers list now, at their latest epochs (for stats)."""
        return int(self.live[self._peer_idx].sum())

    def hold(self, on: bool) -> None:
        """Tests: freeze (or thaw) the epochs this rank sees published."""
        self.held = self.published[self._peer_idx].min(axis=1) if on else None

    def check_invariants(self) -> None:
        if not self.writer:
            return
        pos = self._pos[self._pos >= 0]
        assert (self.died[pos] == NEVER).all() and (self.born[pos] <= self.epoch).all(), \
            "a listed entry's epochs"
        assert np.array_equal(self.slot[pos], np.flatnonzero(self._pos >= 0)), "an entry names another slot"
        assert self._taken[pos // self.row, pos % WAYS].all(), "a listed entry's way is free"

    def unlink(self) -> None:
        if self._memory is not None:
            self._memory.unlink()

    def close(self) -> None:
        if self._memory is None:
            return
        for mv in (self._e, self._fp_bytes, self._slot, self._born, self._died):
            mv.release()
        self.published = self.seen = self.live = self.fp = self.slot = self.born = self.died = None
        self._memory.close()
        self._memory = None
