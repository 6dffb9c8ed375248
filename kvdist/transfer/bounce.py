"""Pinned bounce buffers for the disk batches that touch GPU memory (a spill's GPU ->
bounce -> disk, a reload's disk -> bounce -> GPU), reused rather than allocated per batch.

A pinned allocation costs the host milliseconds, and more the bigger it is (the H200
machine, 2026-12-01: 2.6 ms a step at capacity went to ``torch.empty(pin_memory=True)``
for about four reloaded blocks a step; kept buffers still cost 1.4-4.3 ms a step while
a batch as long as a whole prefix could ask for a new buffer of hundreds of MiB). So:

* the engine cuts reloads and spills into batches of at most ``bounce_blocks`` blocks
  (``BOUNCE_BATCH_BYTES``), so no buffer is bigger than that;
* buffers are kept: ``take(n)`` hands out the smallest free buffer holding at least
  ``n`` blocks (a new one, of a power-of-two number of blocks, when none is free),
  ``give(buf)`` takes it back once its batch is complete (its worker done and its GPU
  half run); ``reserve`` allocates some up front, with the tiers, not in a step.

Buffers are whole: two batches never share one, so no batch overwrites another's."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import torch

__all__ = ["BOUNCE_BATCH_BYTES", "BouncePool", "bounce_blocks"]

BOUNCE_BATCH_BYTES = 64 << 20  # the most a reload or spill batch moves (through one buffer)


def bounce_blocks(block_bytes: int) -> int:
    """Blocks in a reload or spill batch at most (``BOUNCE_BATCH_BYTES``, at least 1)."""
    return max(1, BOUNCE_BATCH_BYTES // block_bytes)


def _blocks(buf: torch.Tensor) -> int:
    return buf.shape[0]


class BouncePool:
    """Pinned ``[blocks, block_bytes]`` uint8 buffers, kept for reuse. Not thread-safe:
    the executor's submitting thread takes and gives."""

    def __init__(self, block_bytes: int, allocate: Callable[[int], torch.Tensor] | None = None):
        self.block_bytes = block_bytes
        self._allocate = allocate or self._pinned
        self._free: list[torch.Tensor] = []  # by capacity, smallest first
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> buffer
        self.allocations = 0
        self.allocation_seconds = 0.0

    def _pinned(self, blocks: int) -> torch.Tensor:
        return torch.empty((blocks, self.block_bytes), dtype=torch.uint8, pin_memory=True)

    def reserve(self, blocks: int, count: int) -> None:
        """Allocate ``count`` free buffers of ``blocks`` blocks now (at start-up)."""
        for _ in range(count):
            self.allocations += 1
            bisect.insort(self._free, self._allocate(blocks), key=_blocks)

    def take(self, n: int) -> torch.Tensor:
        """A buffer of at least ``n`` block rows; the caller uses its first ``n``."""
        assert n > 0, "a bounce buffer for no blocks"
        i = bisect.bisect_left(self._free, n, key=_blocks)  # the smallest that holds n
        if i < len(self._free):
            buf = self._free.pop(i)
        else:
            t0 = time.perf_counter()
            buf = self._allocate(1 << (n - 1).bit_length())
            self.allocations += 1
            self.allocation_seconds += time.perf_counter() - t0
        self._lent[buf.data_ptr()] = buf
        return buf

    def give(self, buf: torch.Tensor) -> None:
        """``buf`` (from ``take``) is no longer read or written by anyone."""
        kept = self._lent.pop(buf.data_ptr(), None)
        assert kept is buf, "a bounce buffer given back twice, or not from this pool"
        bisect.insort(self._free, buf, key=_blocks)

    @property
    def lent(self) -> int:
        return len(self._lent)

    def check_invariants(self) -> None:
        free = {b.data_ptr() for b in self._free}
        assert len(free) == len(self._free), "a buffer is free twice"
        assert not free & self._lent.keys(), "a buffer is free and lent at once"
        sizes = [b.shape[0] for b in self._free]
        assert sizes == sorted(sizes), "the free list is out of order"
        assert all(b.shape[1] == self.block_bytes for b in self._free), "a buffer of another block size"
