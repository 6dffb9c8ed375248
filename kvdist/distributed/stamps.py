"""Per-slot stamps of a host tier: the seqlock that lets another replica read a block
out of this rank's host tier and know whether it got the block it asked for (rule R2).

Each host slot has three uint64: a generation and the block's 128-bit hash. The
generation is even while the slot holds a whole block whose hash is the stamped one,
odd while it holds nothing (free, or a copy into it is queued or running). The owner
(only it writes its stamps) makes a slot odd *before* any copy into it can start —
when its bookkeeping reuses or frees the slot — and even again, with the new hash,
only once the copy into it is known complete. A reader records the generation and
hash, copies the bytes, and reads the generation again: the block is good only if the
generation was even, the hash the one wanted, and the generation unchanged after the
bytes were read. A reader never trusts bytes whose second reading it has not done.

The stamps live in a shared-memory file when the host tier is shared (peers on the
node read them straight from this mapping), else in private memory (the owner checks
them itself when it serves a fetch request). Stores are ordered on x86 (TSO); the
owner's and readers' accesses are separate numpy operations, never reordered there."""

from __future__ import annotations

import numpy as np

from ..storage.host import HostMemory, SharedMemoryUnavailable

GEN, HI, LO = 0, 1, 2
_NUMPY_FROM = 256  # slots: fewer are invalidated word by word (invalidate_slots: cheaper up to here)


class SlotStamps:
    """``arr[slot] = (generation, hash hi, hash lo)`` for ``num_slots`` host slots (local
    indices). ``shared_path``: in that file (created, or mapped with ``attach``)."""

    def __init__(self, num_slots: int, shared_path: str | None = None, attach: bool = False):
        self.num_slots = num_slots
        self._memory: HostMemory | None = None
        nbytes = max(num_slots, 1) * 24
        if shared_path is None:
            self.arr = np.zeros((num_slots, 3), dtype=np.uint64)
        else:
            self._memory = HostMemory(nbytes, shared_path=shared_path, attach=attach,
                                      huge_pages=False, progress=False, threads=1)
            self.arr = self._memory.flat.numpy()[: num_slots * 24].view(np.uint64).reshape(num_slots, 3)
        if not attach:
            self.arr[:, GEN] = 1  # every slot starts empty
        self._words = memoryview(self.arr.reshape(-1))  # the owner's per-slot writes, no numpy call
        self._gen = self.arr[:, GEN]  # a view: the owner's writes of many slots
        self.shared_path = shared_path

    # -- the owner's side ---------------------------------------------------------------------
    def invalidate(self, slots) -> None:
        """The slots' blocks are going: odd generations from now on (idempotent)."""
        gen = self._gen
        gen[slots] = gen[slots] | np.uint64(1)

    def invalidate_slots(self, slots: list[int], base: int = 0) -> None:
        """``invalidate`` of ``slots`` less ``base``: a few word by word (no numpy
        call), more with numpy (a handful of calls, whatever their number)."""
        if len(slots) >= _NUMPY_FROM:
            at = np.array(slots, dtype=np.int64)
            at -= base
            self.invalidate(at)
            return
        words, off = self._words, 3 * base - GEN
        for s in slots:
            at = 3 * s - off
            g = words[at]
            if not g & 1:
                words[at] = g + 1

    def invalidate_one(self, slot: int) -> None:
        """``invalidate`` of one slot, without a numpy call."""
        words, at = self._words, 3 * slot + GEN
        g = words[at]
        if not g & 1:
            words[at] = g + 1

    def publish(self, slots, hi, lo) -> None:
        """The slots now hold whole blocks of these hashes: hash first, then the even
        generation that makes it valid."""
        slots = np.asarray(slots, dtype=np.int64)
        assert (self.arr[slots, GEN] & np.uint64(1)).all(), "publishing a slot that was never invalidated"
        self.arr[slots, HI] = hi
        self.arr[slots, LO] = lo
        self.arr[slots, GEN] = self.arr[slots, GEN] + np.uint64(1)

    # -- a reader's side --------------------------------------------------------------------------
    def before(self, slots, hi, lo) -> tuple[np.ndarray, np.ndarray]:
        """(generations, ok) read before the bytes: ok where the slot holds the block of
        the wanted hash."""
        gen = self.arr[slots, GEN].copy()
        ok = ((gen & np.uint64(1)) == 0) & (self.arr[slots, HI] == hi) & (self.arr[slots, LO] == lo)
        return gen, ok

    def unchanged(self, slots, gen: np.ndarray) -> np.ndarray:
        """Read after the bytes: where the generation is still the one read before."""
        return self.arr[slots, GEN] == gen

    def read_guarded(self, slots: np.ndarray, hi: np.ndarray, lo: np.ndarray,
                     check: bool = True) -> GuardedRead:
        """R2's reader side, opened before the bytes are read (``check`` False: rule R2
        off, every block taken as good)."""
        return GuardedRead(self, slots, hi, lo, check)

    def check_owner(self, hi: np.ndarray, lo: np.ndarray, cached: np.ndarray) -> None:
        """Owner invariant: a slot with an even generation is a cached slot stamped with
        its block's hash (``hi``/``lo``/``cached`` per local slot)."""
        even = (self.arr[:, GEN] & np.uint64(1)) == 0
        bad = even & ~(cached & (self.arr[:, HI] == hi) & (self.arr[:, LO] == lo))
        assert not bad.any(), f"host slots {np.flatnonzero(bad)[:8].tolist()} stamped valid wrongly"

    def unlink(self) -> None:
        if self._memory is not None:
            self._memory.unlink()

    def close(self) -> None:
        self._words.release()
        self.arr = self._gen = None
        if self._memory is not None:
            self._memory.close()
            self._memory = None


class GuardedRead:
    """One seqlock read of ``slots`` (rule R2), the same for every reader: the
    generations and hashes read before the bytes (``ok``: the slot held the block
    wanted), then ``verify`` after them. A block is good only where both say so."""

    __slots__ = ("_gen", "_stamps", "ok", "slots")

    def __init__(self, stamps: SlotStamps, slots: np.ndarray, hi: np.ndarray, lo: np.ndarray, check: bool):
        self._stamps, self.slots = stamps, slots
        if check:
            self._gen, self.ok = stamps.before(slots, hi, lo)
        else:
            self._gen, self.ok = None, np.ones(len(slots), dtype=bool)

    def verify(self, among: np.ndarray | None = None) -> np.ndarray:
        """After the bytes were read: good blocks (of those at indices ``among``, all by
        default): ok before, and the generation unchanged since."""
        ok = self.ok if among is None else self.ok[among]
        if self._gen is None:
            return ok.copy()
        slots, gen = (self.slots, self._gen) if among is None else (self.slots[among], self._gen[among])
        return ok & self._stamps.unchanged(slots, gen)


__all__ = ["GuardedRead", "SharedMemoryUnavailable", "SlotStamps"]
