"""The holder's side of the remote tier: what this rank's host tier tells the other
replicas (docs/design.md, "Remote tier").

The manager reports every host slot that gets or loses a block (``HostObserver``). The
slot's stamp goes odd at once, before any copy into it can start (rule R2); the slot is
remembered. Every few steps (``publish`` then ``send``, called by the remote tier at
``end_step``) the slots filled whose copy is complete are stamped valid with their
block's hash, and the slots changed since the last message go to the peers as
directory records, each slot once however often it changed (rule R4's messages). Per
change this costs one word written and two list appends; the rest is a handful of
numpy operations per message, whatever the number of slots."""

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
        self._touched: list[int] = []  # local host slots changed since the last message (repeats)
        self._filled: list[int] = []  # local host slots filled since the last publish (repeats)
        self._waiting: list[int] = []  # filled, their copy still running at the last publish

    def host_filled(self, slot: int) -> None:
        local = slot - self.host_base
        self.stamps.invalidate_one(local)
        self._touched.append(local)
        self._filled.append(local)

    def host_emptied(self, slot: int) -> None:
        local = slot - self.host_base
        self.stamps.invalidate_one(local)
        self._touched.append(local)

    def publish(self) -> None:
        """Stamp valid the host slots filled whose incoming copy is complete (one
        emptied again meanwhile stays invalid; one whose copy still runs waits)."""
        if not (self._filled or self._waiting):
            return
        fresh = set(self._filled)
        fresh.update(self._waiting)
        self._filled.clear()
        local = np.fromiter(fresh, dtype=np.int64, count=len(fresh))
        slots = local + self.host_base
        cached = self.slots.cached(slots)
        local, slots = local[cached], slots[cached]
        pending = self.slots.writes_pending(slots)
        ready = ~pending
        self.stamps.publish(local[ready], *self.slots.stamps_of(slots[ready]))
        self._waiting = local[pending].tolist()

    def send(self) -> None:
        """The host slots changed since the last message, as they are now, to every peer."""
        if not self._touched:
            return
        touched = set(self._touched)
        self._touched.clear()
        local = np.fromiter(touched, dtype=np.int64, count=len(touched))
        local.sort()
        slots = local + self.host_base
        held = self.slots.cached(slots)
        hi, lo = self.slots.stamps_of(slots)
        self.channel.send(encode(local, held, hi * held, lo * held))
