"""The cache side of the events: a :class:`~kvdist.block_pool.BlockObserver` that writes
down, in order, what changed the blocks of the tiers during a step. It does the least
it can on the step's path — one tuple appended per registration, per run of moves (the
pool's, handed over whole at ``submit_moves``), per drop and per landing — and leaves
working out which block each change concerns, and building and encoding the events, to
the publisher's thread (``kvdist.events.batcher``).

What the thread cannot work out later is captured now (the slots may be reused before
the thread runs): the 128-bit hash of the block before a registration's first, from
which the thread chains the registered blocks' hashes from their token ids as the
manager did (a sequence's slots and tokens only grow: the record holds the sequence's
own lists and the range), and a landed block's hash. Moves and drops name slots alone: the thread
follows each block from slot to slot in its own copy of the slots' hashes.

Records, oldest first:

* ``(REGISTERED, slots, int32 token ids, start, end, parent 128-bit hash | None)``: a
  sequence's GPU ``slots[start:end]`` registered its blocks ``start .. end-1``
  (``tokens_per_block`` token ids a block), chained from the parent (None: the first
  block, chained from the layout's salt); a block whose hash is cached already stays
  private (no event);
* ``(MOVED, srcs, dsts)``: the blocks of ``srcs`` moved to ``dsts``, in order;
* ``(DROPPED, slot, after)``: the block of ``slot`` left the cache after the first
  ``after`` moves of the next ``MOVED`` record (0 when none follows in its call);
* ``(LANDED, slot, wire hash)``: a block fetched from another replica;
* ``(CLEARED,)``: every block is gone (the cache closes)."""

from __future__ import annotations

from array import array

from ..blocks import BlockMeta

__all__ = ["CLEARED", "DROPPED", "LANDED", "MOVED", "REGISTERED", "BlockRecorder", "Record"]

REGISTERED, MOVED, DROPPED, LANDED, CLEARED = range(5)

Record = tuple


class BlockRecorder:
    """Records what changes the tiers' blocks (see the module docstring). Driven by the
    manager's pool on the scheduler thread; ``take`` hands the records of a step over
    and starts the next."""

    def __init__(self, meta: BlockMeta, tokens_per_block: int):
        self._hi, self._lo = meta.hi_mv, meta.lo_mv  # a block's 128-bit hash; the low half: its wire hash
        self._tpb = tokens_per_block
        self._log: list[Record] = []

    # -- the BlockObserver protocol --------------------------------------------------------------
    def registered(self, slots: list[int], tokens: array, start: int, end: int) -> None:
        # The sequence's own lists, not copies: they only grow (kvdist.sequences.Sequence),
        # so what lies below ``end`` stays as it is for the thread.
        p = slots[start - 1] if start else None
        self._log.append((REGISTERED, slots, tokens, start, end,
                          None if p is None else self._hi[p] << 64 | self._lo[p]))

    def moved(self, srcs: list[int], dsts: list[int]) -> None:
        self._log.append((MOVED, srcs, dsts))

    def dropped(self, slot: int, after: int) -> None:
        self._log.append((DROPPED, slot, after))

    def landed(self, slot: int) -> None:
        self._log.append((LANDED, slot, self._lo[slot]))

    # -- steps -------------------------------------------------------------------------------------
    def cleared(self) -> None:
        """Every block is gone (the cache closes)."""
        self._log.append((CLEARED,))

    def take(self) -> list[Record]:
        """The records since the last call, oldest first."""
        log, self._log = self._log, []
        return log
