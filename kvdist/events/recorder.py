"""The cache side of the events: a :class:`~kvdist.block_pool.BlockObserver` whose one
flat typed array holds what changed the blocks of the tiers during a step — no Python
object per block or per change is kept: ``ops``, unsigned 64-bit words, the
registered blocks' int32 token ids among them. The manager's pool writes each change's
words into it as it makes it, with no call into the recorder (the opcodes are
``BlockObserver``'s, which this module re-exports); ``hand_over``, once a step, fills
in the header and hands the step's words to the publisher as a view of the array,
which it copies as they are (``kvdist.events.process``: into the ring of another
process); the next step's words follow them in the array. Working out which block
each change concerns, and building and encoding the events, is the builder's
(``kvdist.events.batcher``), off the step's path.

What the builder cannot work out later is captured by the pool (the slots are
reused): a registration's slots and token ids, the 128-bit hash of the block before
its first (from which the builder chains the registered blocks' hashes as the manager
did), and a landed block's wire hash. Moves and drops name slots alone: the builder
follows each block from slot to slot in its own copy of the slots' hashes.

``ops`` starts with two header words — its own length in words and the time of the
hand-over (ns since the epoch) — filled in by ``hand_over`` (or ``take``): a step's
``ops`` is then one self-describing message. Then, oldest first, each entry an opcode
and its words:

* ``REGISTERED n p hi lo slot*n ids``: the GPU slots registered ``n`` blocks, chained
  from the parent hash ``hi << 64 | lo`` (``p`` = 1), or from the layout's salt (``p``
  = 0: a sequence's first block); a block whose hash is cached already stays private
  (no event). ``ids``: the blocks' ``n * tokens_per_block`` int32 token ids, two a
  word in memory order, the last word padded with a zero id when their count is odd;
* ``MOVED n src*n dst*n``: the blocks of ``srcs`` moved to ``dsts``, in order;
* ``DROPPED slot after``: the block of ``slot`` left the cache after the first ``after``
  moves of the next ``MOVED`` (0 when none follows in its call);
* ``LANDED slot hash``: a block fetched from another replica (its wire hash);
* ``CLEARED``: every block is gone (the cache closes).

:func:`records` turns a step's array back into tuples, for the builder."""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterator

from ..block_pool import LOG_DROPPED, LOG_LANDED, LOG_MOVED, LOG_REGISTERED

__all__ = ["CLEARED", "DROPPED", "HEADER_WORDS", "LANDED", "MOVED", "REGISTERED", "BlockRecorder", "Record",
           "StepRecords", "records", "step_time", "token_words"]

# The pool writes the words of these four (BlockObserver); CLEARED is the recorder's own.
REGISTERED, MOVED, DROPPED, LANDED = LOG_REGISTERED, LOG_MOVED, LOG_DROPPED, LOG_LANDED
CLEARED = 4

Record = tuple
StepRecords = array | memoryview  # one step's records (u64 words), the header first
HEADER_WORDS = 2
_BLANK = array("Q", (HEADER_WORDS, 0))  # a step's ops before its first record


def token_words(n_ids: int) -> int:
    """The words ``n_ids`` int32 token ids take in ``ops`` (two a word)."""
    return (n_ids + 1) >> 1


class BlockRecorder:
    """Records what changes the tiers' blocks (see the module docstring): the manager's
    pool appends to ``ops`` on the scheduler thread; ``hand_over`` (or ``take``) hands
    the records of a step over and starts the next.

    The array is not emptied each step (emptying gives its memory back, and the next
    step's records take it again a piece at a time): a step's records are ``ops`` from
    its header on (``_start``), the next step's header is appended after them, and the
    array starts again at the front once it holds over ``KEEP_WORDS``."""

    KEEP_WORDS = 1 << 16  # 512 KiB

    def __init__(self) -> None:
        self.ops = _BLANK[:]  # BlockObserver's: the current step's header at _start, its words after it
        self._start = 0
        self._cleared = False

    def cleared(self) -> None:
        """Every block is gone (the cache closes): the last record of the next hand-over."""
        self._cleared = True

    def hand_over(self, submit: Callable[[StepRecords], None]) -> None:
        """``submit(step)`` with the records since the last hand-over, the header filled
        in, then start afresh; nothing when nothing changed. ``step`` is a view of the
        recorder's own array, released once ``submit`` returns: it copies what it keeps."""
        ops, start = self.ops, self._start
        n = len(ops) - start
        if n == HEADER_WORDS and not self._cleared:
            return
        if self._cleared:
            ops.append(CLEARED)
            n += 1
            self._cleared = False
        ops[start] = n
        ops[start + 1] = time.time_ns()
        step = memoryview(ops)[start:]
        try:
            submit(step)
        finally:
            step.release()
        if len(ops) > self.KEEP_WORDS:
            del ops[HEADER_WORDS:]
            self._start = 0
        else:
            self._start = len(ops)
            ops.extend(_BLANK)

    def take(self) -> array:
        """The records since the last hand-over, as an array of their own (the header
        alone when nothing changed: do not send it)."""
        out: list[array] = []
        self.hand_over(lambda step: out.append(array("Q", step.tobytes())))
        return out[0] if out else _BLANK[:]


def step_time(ops: array | memoryview) -> float:
    """The time a step's records were handed over (seconds since the epoch)."""
    return ops[1] / 1e9


def records(ops: StepRecords, tpb: int) -> Iterator[Record]:
    """A step's ``ops`` as tuples, oldest first: ``(REGISTERED, slots, token ids (array
    "i"), parent 128-bit hash | None)``, ``(MOVED, srcs, dsts)``, ``(DROPPED, slot,
    after)``, ``(LANDED, slot, wire hash)``, ``(CLEARED,)``."""
    i, n_ops = HEADER_WORDS, len(ops)
    while i < n_ops:
        op = ops[i]
        if op == REGISTERED:
            n, has_parent = ops[i + 1], ops[i + 2]
            parent = ops[i + 3] << 64 | ops[i + 4] if has_parent else None
            i += 5
            slots = list(ops[i : i + n])
            i += n
            ids, w = n * tpb, token_words(n * tpb)
            toks = array("i", ops[i : i + w].tobytes())
            del toks[ids:]  # the padding
            yield REGISTERED, slots, toks, parent
            i += w
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
    assert i == n_ops, f"the records run {i - n_ops} words past the step's"
