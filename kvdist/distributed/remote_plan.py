"""Fetch planning of the remote tier (docs/design.md, "Remote tier", a fetcher): which of
a prompt's blocks to fetch from which peer replica, the landing slots reserved for
them here, and the blocks on their way until the replica decides each one.

Invariants (``Landings.check_invariants``): every undecided block of an in-flight
batch is in ``on_way`` (by hash) and counted in ``used`` of its landing tier; the
manager's LANDING slots are exactly the unreleased landing slots of in-flight batches.
A prefetch holds at most half of a tier's slots (``cap``); the rest keeps caching.

Every TP rank of a replica plans the same batches for the same call: its directory
(agreed, R4), its cache (R1) and ``near`` (the start-up table) are equal."""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable
from typing import Protocol

import numpy as np

from ..eviction import DEFAULT_PRIORITY
from ..prefix import MASK64
from .directory import Directory
from .host_changes import HostSlots
from .remote_figures import RemoteCounters
from .transport import Batch, Fetcher

__all__ = ["Landings", "LocalSlots", "split_hashes"]


class LocalSlots(HostSlots, Protocol):
    """What the remote tier needs from this rank's manager (``kvdist.landing.ManagerSlots``)."""

    tokens_per_block: int
    executor: object

    def block_hashes(self, tokens: Iterable[int]) -> list[int]: ...
    def cached_prefix(self, hashes: list[int]) -> list[int]: ...
    def tier_of(self, h: int) -> int | None: ...
    def reserve(self, tier: int, n: int) -> list[int]: ...
    def land(self, slot: int, h: int, priority: int = DEFAULT_PRIORITY) -> bool: ...
    def release(self, slot: int) -> None: ...
    def landing_slots(self) -> np.ndarray: ...
    def pending_events(self, slots) -> list: ...


def split_hashes(hashes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo) uint64 halves of 128-bit hashes."""
    return (np.array([h >> 64 for h in hashes], dtype=np.uint64),
            np.array([h & MASK64 for h in hashes], dtype=np.uint64))


class Landings:
    """The blocks on their way to this rank and the plans that start them (see the
    module docstring). ``near``: the peers whose blocks a prefetch leaves to
    add_sequence's own fetch (``RemoteTier.near``)."""

    def __init__(self, directory: Directory, transports: dict[int, Fetcher], slots: LocalSlots,
                 capacity: dict[int, int], timeout_s: float, counters: RemoteCounters,
                 near: frozenset[int] = frozenset()):
        self.directory = directory
        self.transports = transports  # peer replica -> transport
        self.slots = slots
        self.timeout_s = timeout_s
        self.counters = counters
        self.near = near
        self.cap = {t: n // 2 for t, n in capacity.items()}  # landing slots a prefetch may hold
        self.used = dict.fromkeys(capacity, 0)  # landing slots of undecided blocks, by tier
        self.on_way: dict[int, Batch] = {}  # hash -> the batch fetching it (until decided)

    def plan(self, hashes: list[int], seq_id: Hashable | None) -> list[Batch]:
        """Reserve landing slots for the blocks of ``hashes`` a fetch starts (``wanted``)
        and start the batches, one per holder and landing tier. ``hashes`` start after
        the local cached prefix; ``seq_id``: a prefetch's request (None: add_sequence's
        own fetch)."""
        prefetch = seq_id is not None
        blocks = self.wanted(hashes, prefetch)
        if not blocks:
            return []
        per_batch: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (peer, tier) -> blocks
        for h, peer, slot in blocks:
            tier = self.transports[peer].landing_tier(prefetch)
            if prefetch and self.used[tier] >= self.cap[tier]:
                break  # prefetches leave half of a tier to caching
            got = self.slots.reserve(tier, 1)
            if not got:
                break
            self.used[tier] += 1
            per_batch.setdefault((peer, tier), []).append((h, slot, got[0]))
        deadline = time.monotonic() + self.timeout_s
        return [self._start(peer, tier, blocks, deadline, seq_id)
                for (peer, tier), blocks in per_batch.items()]

    def _start(self, peer: int, tier: int, blocks: list[tuple[int, int, int]], deadline: float,
               seq_id: Hashable | None) -> Batch:
        """One batch of ``blocks`` (hash, the peer's slot, the landing slot here), started."""
        hs = [h for h, _, _ in blocks]
        hi, lo = split_hashes(hs)
        b = Batch(peer, np.array([s for _, s, _ in blocks], dtype=np.int64), hi, lo,
                  np.array([d for _, _, d in blocks], dtype=np.int64), tier, deadline, seq_id)
        for h in hs:
            self.on_way[h] = b
        self.transports[peer].start(b)
        self.counters.batches += 1
        self.counters.blocks_requested += len(b)
        return b

    def wanted(self, hashes: list[int], prefetch: bool) -> list[tuple[int, int, int]]:
        """(hash, peer, the peer's slot) of the blocks a fetch of ``hashes`` starts. It
        walks them in prompt order, up to the first block no peer lists or one already on
        its way here, and passes over blocks cached here (a prefetch landed them) and,
        for a prefetch, those a ``near`` peer holds: add_sequence's own fetch lands them
        in the prompt's GPU slots at admission, as fast as a host onboard, while the
        prefetch starts only the other peers' blocks (a request with both kinds). Every
        TP rank walks alike: equal directories (R4), caches and ``near`` (R1)."""
        out = []
        directory, near, on_way, slots = self.directory, self.near, self.on_way, self.slots
        for h in hashes:
            if h in on_way:
                break
            if slots.tier_of(h) is not None:
                continue
            g = directory.find(h)
            if g < 0:
                break
            peer, slot = directory.holder(g)
            if prefetch and peer in near:
                continue
            out.append((h, peer, slot))
        return out

    def untrack(self, b: Batch, i: int, h: int) -> None:
        """Block ``i`` (hash ``h``) of ``b`` is decided: no longer on its way."""
        if self.on_way.get(h) is b:
            del self.on_way[h]
        self.used[b.tier] -= 1

    def check_invariants(self, inflight: list[Batch]) -> None:
        expected = np.sort(np.concatenate([b.dst[~b.released] for b in inflight])
                           if inflight else np.zeros(0, dtype=np.int64))
        assert np.array_equal(expected, self.slots.landing_slots()), \
            "landing slots differ from the unreleased blocks of in-flight batches"
        undecided = sum(int((~b.decided).sum()) for b in inflight)
        assert undecided == len(self.on_way), "blocks on their way != in-flight undecided blocks"
        used = dict.fromkeys(self.used, 0)
        for b in inflight:
            used[b.tier] += int((~b.decided).sum())
        assert used == self.used, f"landing counts {self.used}, expected {used}"
