"""The cache side of the events: a :class:`~kvdist.block_pool.BlockObserver` whose two
flat typed arrays hold what changed the blocks of the tiers during a step — no Python
object per block or per change is kept: ``ops`` (unsigned 64-bit words) and ``toks``
(the registered blocks' token ids, int32). The manager's pool writes each change's
words into them as it makes it, with no call into the recorder (the opcodes are
``BlockObserver``'s, which this module re-exports); ``take``, once a step, fills in
the header and hands the step's pair over, and the publisher
(``kvdist.events.process``: another process) copies their bytes as they are. Working
out which block each change concerns, and building and encoding the events, is the
builder's (``kvdist.events.batcher``), off the step's path.

What the builder cannot work out later is captured by the pool (the slots are
reused): a registration's slots and token ids, the 128-bit hash of the block before
its first (from which the builder chains the registered blocks' hashes as the manager
did), and a landed block's wire hash. Moves and drops name slots alone: the builder
follows each block from slot to slot in its own copy of the slots' hashes.

``ops`` starts with three header words — its own length in words, the number of
``toks``, the time of ``take`` (ns since the epoch) — filled in by ``take``: a step's
``ops`` and ``toks`` are then one self-describing message. Then, oldest first, each
entry an opcode and its words:

* ``REGISTERED n p hi lo slot*n``: the GPU slots registered ``n`` blocks
  (``tokens_per_block`` ids each, next in ``toks``), chained from the parent hash
  ``hi << 64 | lo`` (``p`` = 1), or from the layout's salt (``p`` = 0: a sequence's
  first block); a block whose hash is cached already stays private (no event);
* ``MOVED n src*n dst*n``: the blocks of ``srcs`` moved to ``dsts``, in order;
* ``DROPPED slot after``: the block of ``slot`` left the cache after the first ``after``
  moves of the next ``MOVED`` (0 when none follows in its call);
* ``LANDED slot hash``: a block fetched from another replica (its wire hash);
* ``CLEARED``: every block is gone (the cache closes).

:func:`records` turns a step's pair back into tuples, for the builder."""

from __future__ import annotations

import time
from array import array
from collections.abc import Iterator

from ..block_pool import LOG_DROPPED, LOG_LANDED, LOG_MOVED, LOG_REGISTERED
from ..blocks import BlockMeta

__all__ = ["CLEARED", "DROPPED", "HEADER_WORDS", "LANDED", "MOVED", "REGISTERED", "BlockRecorder", "Record",
           "StepRecords", "records", "step_time"]

# The pool writes the words of these four (BlockObserver); CLEARED is the recorder's own.
REGISTERED, MOVED, DROPPED, LANDED = LOG_REGISTERED, LOG_MOVED, LOG_DROPPED, LOG_LANDED
CLEARED = 4

Record = tuple
StepRecords = tuple  # (ops: array("Q"), toks: array("i")) of one step
HEADER_WORDS = 3
_BLANK = array("Q", (HEADER_WORDS, 0, 0))  # a step's ops before its first record
_EMPTY: StepRecords = (_BLANK, array("i"))


class BlockRecorder:
    """Records what changes the tiers' blocks (see the module docstring): the manager's
    pool appends to ``ops`` and ``toks`` on the scheduler thread; ``take`` hands the
    records of a step over and starts the next."""

    def __init__(self, meta: BlockMeta, tokens_per_block: int):
        self.ops = _BLANK[:]  # BlockObserver's: the words since the last take, the header first
        self.toks: list[array] = []  # ... and the registrations' token ids
        self._cleared = False

    def cleared(self) -> None:
        """Every block is gone (the cache closes): the last record of the next ``take``."""
        self._cleared = True

    def take(self) -> StepRecords:
        """The records since the last call, ``(ops, toks)``, the header filled in
        (``ops`` of the header alone when nothing changed: do not send it)."""
        ops, parts = self.ops, self.toks
        if len(ops) == HEADER_WORDS and not self._cleared:
            return _EMPTY
        if self._cleared:
            ops.append(CLEARED)
            self._cleared = False
        out = ops[:]  # the pool keeps appending to ops
        del ops[HEADER_WORDS:]
        if len(parts) == 1:
            toks = parts[0]
        else:  # one copy each (an array grown part by part is copied again at each growth)
            toks = array("i")
            toks.frombytes(b"".join(parts))
        parts.clear()
        out[0], out[1], out[2] = len(out), len(toks), time.time_ns()
        return out, toks


def step_time(ops: array | memoryview) -> float:
    """The time a step's records were taken (seconds since the epoch)."""
    return ops[2] / 1e9


def records(ops: array | memoryview, toks: array | memoryview, tpb: int) -> Iterator[Record]:
    """A step's ``(ops, toks)`` as tuples, oldest first: ``(REGISTERED, slots, token
    ids (array "i"), parent 128-bit hash | None)``, ``(MOVED, srcs, dsts)``,
    ``(DROPPED, slot, after)``, ``(LANDED, slot, wire hash)``, ``(CLEARED,)``."""
    i, t, n_ops = HEADER_WORDS, 0, len(ops)
    while i < n_ops:
        op = ops[i]
        if op == REGISTERED:
            n, has_parent = ops[i + 1], ops[i + 2]
            parent = ops[i + 3] << 64 | ops[i + 4] if has_parent else None
            i += 5
            yield REGISTERED, list(ops[i : i + n]), array("i", toks[t : t + n * tpb]), parent
            i += n
            t += n * tpb
        elif op == MOVED:
            n = ops[i + 1]
            i += 2
            yield MOVED, list(ops[i : i + n]), list(ops[i + n : i + 2 * n])
            i += 2 * n
        elif op == DROPPED or op == LANDED:
            yield op, ops[i + 1], ops[i + 2]
            i += 3
        else:
            assert op == CLEARED, f"unknown record {op} at word {i}"
            yield (CLEARED,)
            i += 1
    assert t == len(toks), f"{len(toks) - t} token ids left over"
