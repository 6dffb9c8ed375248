"""The cache side of the events: a :class:`~kvdist.block_pool.BlockObserver` that writes
down, in order, every block a tier stores or removes during a step. It does the least
it can on the step's path — a tuple appended per change — and leaves building and
encoding the events to the publisher's thread (``kvdist.events.batcher``).

State, per global slot (a list indexed by slot, like the manager's arrays): what the
cached block there is beyond its hash — ``(parent wire hash or None, its int32 token
ids)``, shared by reference as the block moves, so a record stays right whatever later
happens to the slot. A block landed from another replica is known by its hash alone
(``UNKNOWN``: no parent, no tokens)."""

from __future__ import annotations

from array import array

from ..blocks import CACHED, DISK, GPU, HOST, BlockMeta, SlotSpace

__all__ = ["CLEARED", "REMOVED", "STORED", "UNKNOWN", "BlockRecorder", "Record"]

STORED, REMOVED, CLEARED = 0, 1, 2
UNKNOWN: tuple[None, None] = (None, None)  # a landed block: its hash alone

# (STORED, tier, wire hash, (parent wire hash | None, tokens | None)),
# (REMOVED, tier, wire hash) or (CLEARED,)
Record = tuple


class BlockRecorder:
    """Records the blocks each tier stores and removes (see the module docstring).
    Driven by the manager's pool on the scheduler thread; ``take`` hands the records
    of a step over and starts the next."""

    def __init__(self, meta: BlockMeta, space: SlotSpace, tokens_per_block: int):
        self._lo = meta.lo_mv  # the low 64 bits of a block's hash: its wire hash
        self._state = meta.state_mv
        self._host, self._disk = space.base[HOST], space.base[DISK]
        self._tpb = tokens_per_block
        self._info: list[tuple | None] = [None] * space.total
        self._log: list[Record] = []

    def _tier(self, slot: int) -> int:
        return GPU if slot < self._host else (HOST if slot < self._disk else DISK)

    # -- the BlockObserver protocol --------------------------------------------------------------
    def registered(self, slots: list[int], tokens: array, start: int, end: int) -> None:
        lo, state, info, append, tpb = self._lo, self._state, self._info, self._log.append, self._tpb
        parent = lo[slots[start - 1]] if start else None
        t = start * tpb
        for s in slots[start:end]:
            h = lo[s]
            if state[s] == CACHED:
                rec = info[s] = (parent, tokens[t : t + tpb])
                append((STORED, GPU, h, rec))
            parent = h
            t += tpb

    def moved(self, src: int, dst: int) -> None:
        info, host, disk = self._info, self._host, self._disk
        h = self._lo[dst]
        rec = info[src]
        info[src] = None
        info[dst] = rec
        self._log += ((REMOVED, GPU if src < host else (HOST if src < disk else DISK), h),
                      (STORED, GPU if dst < host else (HOST if dst < disk else DISK), h, rec))

    def dropped(self, slot: int) -> None:
        self._info[slot] = None
        self._log.append((REMOVED, GPU if slot < self._host else (HOST if slot < self._disk else DISK),
                          self._lo[slot]))

    def landed(self, slot: int) -> None:
        self._info[slot] = UNKNOWN
        self._log.append((STORED, self._tier(slot), self._lo[slot], UNKNOWN))

    # -- steps -------------------------------------------------------------------------------------
    def cleared(self) -> None:
        """Every block is gone (the cache closes)."""
        self._info = [None] * len(self._info)
        self._log.append((CLEARED,))

    def take(self) -> list[Record]:
        """The records since the last call, oldest first."""
        log, self._log = self._log, []
        return log
