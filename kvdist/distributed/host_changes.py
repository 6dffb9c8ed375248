"""The holder's side of the remote tier: what this rank's host tier tells the other
replicas (docs/design.md, "Remote tier").

The manager's pool reports the host slots that got or lost a block (``HostObserver``),
a run of moves at a time, before the run's copies reach the engine. Their stamps go odd
at once, before any copy into them can start (rule R2); the slots are remembered.
Every few steps (``publish`` then ``send``, called by the remote tier at ``end_step``)
the slots filled whose copy is complete are stamped valid with their block's hash, and
the slots changed since the last message go to the peers as directory records, each
slot once however often it changed (rule R4's messages). A run costs one call, a word
written per slot and three list extensions; a message, a handful of numpy operations
whatever the number of slots."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..blocks import HOST
from .directory import encode
from .directory_channel import DirectoryChannel
from .stamps import SlotStamps


class HostSlots(Protocol):
    """What the holder's side reads of this rank's manager (global slot ids)."""

    def tier_base(self, tier: int) -> int: ...
    def cached(self, slots: np.ndarray) -> np.ndarray: ...
    def stamps_of(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
    def writes_pending(self, slots) -> np.ndarray: ...


class HostChanges:
    """Stamps and directory records of this rank's host tier (see the module
    docstring); the manager's ``HostObserver``."""

    def __init__(self, stamps: SlotStamps, slots: HostSlots, channel: DirectoryChannel):
        self.stamps, self.slots, self.channel = stamps, slots, channel
        self.host_base = slots.tier_base(HOST)
        # Global host slots (repeats): changed since the last message; filled since the
        # last publish; filled, their copy still running at the last publish.
        self._touched: list[int] = []
        self._filled: list[int] = []
        self._waiting: list[int] = []

    def host_changed(self, emptied: list[int], filled: list[int]) -> None:
        self.stamps.invalidate_slots(emptied, self.host_base)  # R2: before any copy into them
        self.stamps.invalidate_slots(filled, self.host_base)
        self._touched += emptied
        self._touched += filled
        self._filled += filled

    def publish(self) -> None:
        """Stamp valid the host slots filled whose incoming copy is complete (one
        emptied again meanwhile stays invalid; one whose copy still runs waits)."""
        if not (self._filled or self._waiting):
            return
        fresh = set(self._filled)
        fresh.update(self._waiting)
        self._filled.clear()
        slots = np.fromiter(fresh, dtype=np.int64, count=len(fresh))
        slots = slots[self.slots.cached(slots)]
        pending = self.slots.writes_pending(slots)
        ready = slots[~pending]
        self.stamps.publish(ready - self.host_base, *self.slots.stamps_of(ready))
        self._waiting = slots[pending].tolist()

    def send(self) -> None:
        """The host slots changed since the last message, as they are now, to every peer."""
        if not self._touched:
            return
        touched = set(self._touched)
        self._touched.clear()
        slots = np.fromiter(touched, dtype=np.int64, count=len(touched))
        slots.sort()
        held = self.slots.cached(slots)
        hi, lo = self.slots.stamps_of(slots)
        self.channel.send(encode(slots - self.host_base, held, hi * held, lo * held))
