"""The transport contract of the remote tier: a batch of blocks fetched from one peer
replica, each block's local outcome, and ``Fetcher`` — what every transport does the
same way, written once — over the one thing each does its own way: moving bytes.

A block's local outcome is three bits, so that a bitwise AND over the TP group (one
MIN-reduce of 0/1 values) gives the replica's verdict (rules R1, R2):

* ``GOOD``   — this rank holds the whole block, stamp checked before and after;
* ``DONE``   — nothing can still write the landing slot (copy finished or cancelled);
* ``NOTBAD`` — this rank has not given up on the block (no stale stamp, no timeout,
  no failed transfer).

Pending is ``NOTBAD`` alone; good is all three; given up is ``DONE`` (or nothing while
a cancelled transfer may still land). The replica lands a block when every rank has it
GOOD, gives it up (a miss) as soon as one rank has it not NOTBAD, and frees the
landing slot of a given-up block once every rank has it DONE.

The contract (``Fetcher.start`` / ``poll`` / ``close``), the same for every transport:

* the fault drill ``remote_fetch`` fails every block at once (given up, DONE);
* the copies into the landing slots follow what the engine still does with them (S2):
  their pending events are handed to the transport's ``_begin``;
* past the batch's deadline the pending blocks are given up (TIMED_OUT): DONE at once
  when the transport could stop its copies, else when they complete. The deadline
  (``fetch_timeout_ms``) counts from when the transport's copies began (``_began``):
  a copy waiting its turn behind this rank's other copies is not late;
* a transfer that completed finishes its blocks: GOOD where the transport says the
  bytes are the block wanted (R2), stale elsewhere.

A transport keeps what it has in flight for a batch in a record of its own type (a
``Transfer``), held by the batch until the transfer completes."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import numpy as np

__all__ = ["DONE", "FAILED", "GOOD", "LANDED", "NOTBAD", "NO_REASON", "PENDING", "REASONS", "STALE",
           "TIMED_OUT", "Batch", "Fetcher", "LandingSlots", "Transfer"]

GOOD, DONE, NOTBAD = 1, 2, 4
PENDING = NOTBAD
LANDED = GOOD | DONE | NOTBAD

# Why a block was given up on this rank (stats; the verdict is the replica's).
NO_REASON, STALE, TIMED_OUT, FAILED = 0, 1, 2, 3
REASONS = ("ok", "stale", "timed_out", "failed")


class Transfer:
    """What a transport has in flight for one batch (each transport subclasses it):
    ``where``, the blocks of the batch its copies write; ``given_up``, set once the
    deadline passed (its copies were asked to stop)."""

    __slots__ = ("given_up", "where")

    def __init__(self, where: np.ndarray):
        self.where = where
        self.given_up = False


@dataclass(slots=True, eq=False)
class Batch:
    """Blocks fetched from ``peer`` in one request: its host slots and the hashes
    wanted there, the landing slots here (global ids, one tier), and per block the
    local outcome bits, the reason of a give-up, and the replica's verdict."""

    peer: int
    peer_slots: np.ndarray  # int64, the peer's local host slots
    hi: np.ndarray  # uint64 halves of the wanted hashes
    lo: np.ndarray
    dst: np.ndarray  # int64 global landing slots, all of tier ``tier``
    tier: int
    deadline: float  # time.monotonic() after which pending blocks are given up, had its copies begun at once
    seq_id: Hashable | None = None  # the prefetch it serves (None: add_sequence's own pull)
    state: np.ndarray = field(init=False)
    reason: np.ndarray = field(init=False)
    decided: np.ndarray = field(init=False)  # the replica's verdict is in (landed or given up)
    released: np.ndarray = field(init=False)  # landed, or given up with its slot freed
    transfer: Transfer | None = None  # the transport's, while its copies are in flight
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        n = len(self.dst)
        self.state = np.full(n, PENDING, dtype=np.uint8)
        self.reason = np.zeros(n, dtype=np.uint8)
        self.decided = np.zeros(n, dtype=bool)
        self.released = np.zeros(n, dtype=bool)

    def __len__(self) -> int:
        return len(self.dst)

    def give_up(self, where: np.ndarray, reason: int, done: bool) -> None:
        """This rank gives up on the blocks ``where`` (a mask) that are still pending."""
        where = where & (self.state == PENDING)
        self.state[where] = DONE if done else 0
        self.reason[where] = reason

    def finish(self, where: np.ndarray, good: np.ndarray) -> None:
        """The copies of ``where`` finished: GOOD where ``good``, stale elsewhere."""
        pending = where & (self.state == PENDING)
        self.state[pending & good] = LANDED
        stale = pending & ~good
        self.state[stale] = DONE
        self.reason[stale] = STALE
        given_up = where & (self.state == 0)  # given up while in flight: now it is done
        self.state[given_up] = DONE

    def deadline_from(self, began: float | None) -> float:
        """The deadline of copies that began at ``began`` (None: not yet: none)."""
        return float("inf") if began is None else self.deadline + max(0.0, began - self.started)

    @property
    def resolved(self) -> bool:
        """No block is still pending on this rank."""
        return not (self.state == PENDING).any()

    @property
    def settled(self) -> bool:
        return bool(self.released.all())


class LandingSlots(Protocol):
    """What a transport needs of this rank's landing slots (global slot ids)."""

    def tier_base(self, tier: int) -> int: ...
    def pending_events(self, slots) -> list: ...


T = TypeVar("T", bound=Transfer)


class Fetcher(ABC, Generic[T]):
    """Fetches batches from one kind of peer into this rank's landing slots: the
    contract of the module docstring, over a transport's ``_begin`` / ``_complete`` /
    ``_good`` / ``_cancel`` on its own in-flight record ``T``."""

    name: str

    def __init__(self, slots: LandingSlots, fail: bool = False):
        self.slots = slots
        self.fail = fail  # fault drill remote_fetch: every fetch of this rank fails

    @abstractmethod
    def landing_tier(self, prefetch: bool) -> int:
        """Where its blocks land here (GPU or HOST), for a prefetch or add_sequence's own fetch."""

    def start(self, batch: Batch) -> None:
        """Begin the copies (or give up on some, or all, at once)."""
        if self.fail:
            batch.give_up(np.ones(len(batch), dtype=bool), FAILED, done=True)
            return
        deps = self.slots.pending_events(batch.dst)  # S2: the engine's copies of the landing slots
        batch.transfer = self._begin(batch, deps)
        self.poll(batch, 0.0)

    def poll(self, batch: Batch, now: float) -> None:
        """Record finished copies in ``batch``; past its deadline, give up what is pending."""
        t: T | None = batch.transfer
        if t is None:
            return
        if self._complete(t):
            batch.transfer = None
            batch.finish(t.where, self._good(batch, t))
        elif not t.given_up and now > batch.deadline_from(self._began(batch, t)):
            t.given_up = True
            stopped = self._cancel(t)
            batch.give_up(t.where, TIMED_OUT, done=stopped)
            if stopped:
                batch.transfer = None

    def progress(self) -> None:
        """Work between polls, at every step boundary (nothing, unless a transport has some)."""

    def close(self, batches: list[Batch]) -> None:
        """Stop: give up ``batches`` (this fetcher's, still in flight); no copy of this
        fetcher may write this rank's memory once ``_close`` returns, unless it keeps
        that memory alive."""
        open_: list[T] = []
        for b in batches:
            t = b.transfer
            if t is None:
                continue
            if not t.given_up:
                t.given_up = True
                self._cancel(t)
            if not self._complete(t):
                open_.append(t)
            b.transfer = None
        self._close(open_)

    # -- what each transport does its own way --------------------------------------------------
    @abstractmethod
    def _begin(self, batch: Batch, deps: list) -> T | None:
        """Start the copies of ``batch`` after ``deps`` (the landing slots' pending events);
        None when nothing was started (every block given up or finished already)."""

    def _began(self, batch: Batch, t: T) -> float | None:
        """When ``t``'s copies began (``time.monotonic``), None while they wait their turn
        behind this rank's earlier copies (a local queue: they will run). By default when
        ``batch`` started (a transport that sends its requests at once)."""
        return batch.started

    @abstractmethod
    def _complete(self, t: T) -> bool:
        """Whether nothing of ``t`` can still write a landing slot (never blocks)."""

    @abstractmethod
    def _good(self, batch: Batch, t: T) -> np.ndarray:
        """Once complete: per block of the batch, whether the bytes landed are the block wanted."""

    @abstractmethod
    def _cancel(self, t: T) -> bool:
        """Ask ``t``'s copies to stop; True when none of them will write any more."""

    @abstractmethod
    def _close(self, open_: list[T]) -> None:
        """Release the transport's resources; ``open_``: transfers that did not complete."""
