"""The words of the block log that the pool and the manager write as they change the
cached blocks (their formats: ``kvdist.block_observers.BlockObserver``): a
registration's, a drop's and a landing's. The pending moves go to the log from the
move queue (``kvdist.move_queue.MoveQueue.hand_over``), whose arrays hold their words
already.

A change is one ``write`` into the observer's log, a C call that parses its argument
(some 700 instructions), so the parts of a change are joined before they are written.
A write that does not fit raises ValueError having written nothing; the observer's
``overflow`` then writes the words. With no observer set, nothing here is called."""

from __future__ import annotations

import struct
from array import array

from .block_observers import LOG_REGISTERED, U64, BlockObserver
from .blocks import BlockMeta

__all__ = ["log_change", "log_registered"]

_PAD = bytes(4)  # a zero token id: an odd count of them fills its last word
_JOIN = b"".join
_THREE_WORDS = struct.Struct(f"3{U64}")  # a drop's or a landing's words


def _registration(n: int) -> struct.Struct:
    """The words of a registration of ``n`` blocks before their token ids."""
    return struct.Struct(f"{5 + n}{U64}")


_REGISTRATIONS = 256
_REGISTRATION = [_registration(n) for n in range(_REGISTRATIONS)]
_ONE_REGISTERED = _REGISTRATION[1].pack


def log_registered(observer: BlockObserver, meta: BlockMeta, slots: list[int], start: int, end: int,
                   tokens: array) -> None:
    """Blocks ``start .. end-1`` of a sequence (GPU ``slots``) were registered, their
    int32 token ids ``tokens``: their words for ``observer``, the hash of the block
    before the first read from ``meta`` now (its slot may be reused before the observer
    reads). One block after others, a decode's, is the common case: it takes a struct
    of its own, with no slice of ``slots``."""
    n = end - start
    if start:
        p = slots[start - 1]
        if n == 1:
            head = _ONE_REGISTERED(LOG_REGISTERED, 1, 1, meta.hi_mv[p], meta.lo_mv[p], slots[start])
        else:
            pack = _REGISTRATION[n].pack if n < _REGISTRATIONS else _registration(n).pack
            head = pack(LOG_REGISTERED, n, 1, meta.hi_mv[p], meta.lo_mv[p], *slots[start:end])
    else:
        pack = _REGISTRATION[n].pack if n < _REGISTRATIONS else _registration(n).pack
        head = pack(LOG_REGISTERED, n, 0, 0, 0, *slots[:end])
    words = _JOIN((head, tokens) if not len(tokens) & 1 else (head, tokens, _PAD))
    try:
        observer.log.write(words)
    except ValueError:
        observer.overflow(words)


def log_change(observer: BlockObserver, op: int, slot: int, word: int) -> None:
    """A drop's or a landing's words (``op``: ``LOG_DROPPED`` or ``LOG_LANDED``) for
    ``observer``."""
    words = _THREE_WORDS.pack(op, slot, word)
    try:
        observer.log.write(words)
    except ValueError:
        observer.overflow(words)
