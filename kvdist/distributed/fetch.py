"""Fetches of the remote tier: a batch of blocks pulled from one peer replica, each
block's local outcome, and the transports that move the bytes.

A block's local outcome is three bits, so that a bitwise AND over the TP group (one
MIN-reduce of 0/1 values) gives the replica's verdict (rules R1, R2):

* ``GOOD``   — this rank holds the whole block, stamp checked before and after;
* ``DONE``   — nothing can still write the landing slot (copy finished or cancelled);
* ``NOTBAD`` — this rank has not given up on the block (no stale stamp, no timeout,
  no failed transfer).

Pending is ``NOTBAD`` alone; good is all three; given up is ``DONE`` (or nothing while
a cancelled transfer may still land). The replica lands a block when every rank has it
GOOD, gives it up (a miss) as soon as one rank has it not NOTBAD, and frees the
landing slot of a given-up block once every rank has it DONE."""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

GOOD, DONE, NOTBAD = 1, 2, 4
PENDING = NOTBAD
LANDED = GOOD | DONE | NOTBAD

# Why a block was given up on this rank (stats; the verdict is the replica's).
NO_REASON, STALE, TIMED_OUT, FAILED = 0, 1, 2, 3
REASONS = ("ok", "stale", "timed_out", "failed")


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
    deadline: float  # time.monotonic() after which pending blocks are given up
    seq_id: Hashable | None = None  # the prefetch it serves (None: add_sequence's own pull)
    state: np.ndarray = field(init=False)
    reason: np.ndarray = field(init=False)
    decided: np.ndarray = field(init=False)  # the replica's verdict is in (landed or given up)
    released: np.ndarray = field(init=False)  # landed, or given up with its slot freed
    handle: object = None  # the transport's
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

    @property
    def resolved(self) -> bool:
        """No block is still pending on this rank."""
        return not (self.state == PENDING).any()

    @property
    def settled(self) -> bool:
        return bool(self.released.all())


class Transport(Protocol):
    """Moves blocks from one kind of peer into this rank's landing slots."""

    name: str
    serves: bool  # whether the holder's side takes part (``service`` does something)

    def landing_tier(self, prefetch: bool) -> int:
        """Where its blocks land here (GPU or HOST), for a prefetch or add_sequence's own fetch."""

    def start(self, batch: Batch) -> None:
        """Begin the copies (or give up on some at once)."""

    def poll(self, batch: Batch, now: float) -> None:
        """Record finished copies in ``batch``; past its deadline, give up what is pending."""

    def service(self) -> None:
        """Serve peers' requests (a transport whose holder takes part)."""

    def close(self) -> None: ...
