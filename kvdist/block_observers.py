"""What the block pool (``kvdist.block_pool``) tells those who watch its slots, with no
Python hook per block change: the host observer (the remote tier's stamps, rule R2)
hears a run of moves at a time; the block observer (the KV cache events) gets each
change's words written into its typed arrays."""

from __future__ import annotations

import mmap
from array import array
from typing import Any, Protocol

Buffer = Any  # a bytes-like object (collections.abc.Buffer from Python 3.12)

__all__ = ["LOG_DROPPED", "LOG_LANDED", "LOG_MOVED", "LOG_REGISTERED", "U64", "BlockObserver", "HostObserver"]

# The block log's typecode: unsigned 64-bit words. "L" where C's unsigned long has 64
# bits (LP64: Linux, macOS), since CPython 3.11 converts an int to an "L" item on a fast
# path and to a "Q" item through a generic one (a list of words is appended about 25%
# faster); "Q" elsewhere. The bytes are the same.
U64 = "L" if array("L").itemsize == 8 else "Q"


class HostObserver(Protocol):
    """Who must know when host slots get or lose their blocks (the remote tier's stamps,
    rule R2): told once per run of moves, before its copies reach the engine."""

    def host_changed(self, emptied: list[int], filled: list[int]) -> None:
        """Host slots (global ids) lost their blocks (``emptied``) and got cached blocks
        (``filled``) since the last call (a slot may be in both, and more than once).
        No copy into a filled slot, nor into an emptied one reused, has reached the
        engine yet; a landed block's bytes are in place. The lists are the observer's
        from then on."""


# The opcodes of the block log (``BlockObserver.log``).
LOG_REGISTERED, LOG_MOVED, LOG_DROPPED, LOG_LANDED = range(4)


class BlockObserver(Protocol):
    """Who must know which cached block each slot of every tier holds (global slot ids;
    a block's hash is in meta). Blocks enter on the GPU (registered by the manager) or
    land from another replica, move between tiers, and leave when dropped.

    Nothing is called per change: the pool writes each change's words into ``log`` (an
    ``mmap``: ``log.write(data)`` appends ``data``'s bytes at its position), in order,
    as it makes it, and the observer takes them once a step. A write that does not fit
    raises ValueError having written nothing (the mmap's "data out of range"); the pool
    then calls ``overflow(data)``, which writes it. The words are ``U64`` items; each
    change is an opcode and its words:

    * ``LOG_REGISTERED n p hi lo slot*n ids``: ``n`` blocks of a sequence were
      registered in these GPU slots: those now CACHED entered the cache, the others
      were cached already; chained from the 128-bit hash ``hi << 64 | lo`` of the
      block before (``p`` = 1), or from the layout's salt (``p`` = 0, ``hi`` = ``lo`` =
      0). ``ids``: their ``n * tokens_per_block`` int32 token ids, two a word in memory
      order, the last word padded with a zero id when their count is odd;
    * ``LOG_MOVED n src*n dst*n``: a run of moves handed to the engine at once
      (``submit_moves``), in order: the cached block of each source now lives in the
      destination of the same index;
    * ``LOG_DROPPED slot after``: the cached block of ``slot`` left the cache, after the
      first ``after`` moves of the next ``LOG_MOVED``;
    * ``LOG_LANDED slot lo``: ``slot`` holds a cached block fetched from another
      replica, the low half of its hash ``lo``."""

    log: mmap.mmap

    def overflow(self, data: Buffer) -> None:
        """Write ``data`` (a bytes-like object), which ``log.write`` found no room for."""
