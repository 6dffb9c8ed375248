"""The cache side of the events: a :class:`~kvdist.block_pool.BlockObserver` whose log
is the memory its reader reads (``kvdist.events.shared_log``): the manager's pool writes
each change's words there as it makes it, with no call into the recorder (the
opcodes are ``BlockObserver``'s, which this module re-exports), and no Python object
per block or per change is kept. ``hand_over``, once a step, ends the step's records
with a trailer and publishes them: nothing is copied at a step's end. Working out
which block each change concerns, and building and encoding the events, is the
builder's (``kvdist.events.batcher``), in the reader's process.

What the builder cannot work out later is captured by the pool (the slots are
reused): a registration's slots and token ids, the 128-bit hash of the block before
its first (from which the builder chains the registered blocks' hashes as the manager
did), and a landed block's wire hash. Moves and drops name slots alone: the builder
follows each block from slot to slot in its own copy of the slots' hashes.

The stream is a sequence of u64 words (``U64``): each entry an opcode and its words
(``BlockObserver`` has those the pool writes), and each step ends with ``STEP_END
time_ns`` (the time of its hand-over, ns since the epoch); a step with no change is
not handed over:

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

:class:`Steps` cuts the stream into steps (each an array of its words, the trailer
last) and :func:`records` turns a step back into tuples, for the builder."""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterator

from ..block_observers import U64
from ..block_pool import LOG_DROPPED, LOG_LANDED, LOG_MOVED, LOG_REGISTERED
from .shared_log import HEAD, HEADER_BYTES, LogWriter

__all__ = ["CLEARED", "DROPPED", "LANDED", "MOVED", "PRIVATE_BYTES", "REGISTERED", "STEP_END",
           "BlockRecorder", "Record", "StepRecords", "Steps", "records", "step_time", "token_words"]

# The pool writes the words of these four (BlockObserver); CLEARED and STEP_END are the recorder's own.
REGISTERED, MOVED, DROPPED, LANDED = LOG_REGISTERED, LOG_MOVED, LOG_DROPPED, LOG_LANDED
CLEARED, STEP_END = 4, 5

Record = tuple
StepRecords = array  # one step's records (U64 words), its trailer last
PRIVATE_BYTES = 1 << 20  # a private log's data area (it starts again at the front past half of it)
_time_ns = time.time_ns
_CLEARED = array(U64, (CLEARED,))


def token_words(n_ids: int) -> int:
    """The words ``n_ids`` int32 token ids take (two a word)."""
    return (n_ids + 1) >> 1


class BlockRecorder(LogWriter):
    """Records what changes the tiers' blocks (see the module docstring): the writing
    end of the block log (``kvdist.events.shared_log``), shared with the publisher's process
    (``fd``, ``wait``: ``LogWriter``'s), or private, read back by ``take``. The manager's
    pool writes into ``log`` on the scheduler thread (``overflow`` when a write does not
    fit); ``hand_over`` ends and publishes the records of a step."""

    def __init__(self, fd: int | None = None, capacity: int = PRIVATE_BYTES,
                 wait: Callable[[bool], bool] | None = None) -> None:
        super().__init__(fd, capacity, wait)
        self._trailer = array(U64, (STEP_END, 0))  # its time set at each hand-over

    def cleared(self) -> None:
        """Every block is gone (the cache closes): the last record of the next hand-over."""
        try:
            self.log.write(_CLEARED)
        except ValueError:
            self.overflow(_CLEARED)

    def hand_over(self) -> bool:
        """End the records written since the last hand-over with their trailer and
        publish them: False (nothing done) when nothing changed."""
        log = self.log
        if log.tell() == self.published:
            return False
        trailer = self._trailer
        trailer[1] = _time_ns()
        try:
            log.write(trailer)
        except ValueError:
            self.overflow(trailer)
        pos = log.tell()
        if pos > self.restart_from or self.slow:
            self.publish()  # the whole of it: starting again at the front, a fence, or nothing published
        else:  # publish's common case, without a call
            self.words[HEAD] = self._head = self._base + pos - HEADER_BYTES
            self.published = pos
            self.steps += 1
        return True

    def take(self) -> StepRecords | None:
        """Private: hand the step over and return its records (None when nothing
        changed)."""
        if not self.hand_over():
            return None
        out = array(U64)
        out.frombytes(self.read_back())
        return out

    def skip(self) -> None:
        """Private: hand the step over to nobody (``bench events``' recording only)."""
        if self.hand_over():
            self.discard()


class Steps:
    """Cuts a stream of records into steps: ``feed`` the bytes as they come (cut
    anywhere), get each whole step's words (``StepRecords``) once its trailer has come."""

    def __init__(self, tokens_per_block: int) -> None:
        self._tpb = tokens_per_block
        self._words = array(U64)
        self._at = 0  # the next record's first word in _words (the steps before it are cut off)
        self._odd = b""  # a word's first bytes, cut off by a read

    def feed(self, data: bytes) -> list[StepRecords]:
        if self._odd:
            data = self._odd + data
        cut = len(data) & ~7
        self._odd = data[cut:]
        w = self._words
        w.frombytes(data[:cut])
        out, i, start, n, tpb = [], self._at, 0, len(w), self._tpb
        while i < n:
            op = w[i]
            if op == MOVED:
                if i + 1 >= n:
                    break
                size = 2 + 2 * w[i + 1]
            elif op == REGISTERED:
                if i + 1 >= n:
                    break
                size = 5 + w[i + 1] + token_words(w[i + 1] * tpb)
            elif op == DROPPED or op == LANDED:
                size = 3
            elif op == STEP_END:
                size = 2
            else:
                assert op == CLEARED, f"unknown record {op} in the stream"
                size = 1
            if i + size > n:
                break
            i += size
            if op == STEP_END:
                out.append(w[start:i])
                start = i
        del w[:start]
        self._at = i - start
        return out


def step_time(ops: StepRecords) -> float:
    """The time a step's records were handed over (seconds since the epoch)."""
    return ops[-1] / 1e9


def records(ops: StepRecords, tpb: int) -> Iterator[Record]:
    """A step's ``ops`` as tuples, oldest first: ``(REGISTERED, slots, token ids (array
    "i"), parent 128-bit hash | None)``, ``(MOVED, srcs, dsts)``, ``(DROPPED, slot,
    after)``, ``(LANDED, slot, wire hash)``, ``(CLEARED,)``; the trailer is not one."""
    i, n_ops = 0, len(ops) - 2
    assert ops[n_ops] == STEP_END, "a step's records end with its trailer"
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
