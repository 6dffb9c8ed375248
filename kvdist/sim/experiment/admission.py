"""Admission behind prefetches: once the scheduler has reserved a runnable request's
GPU blocks, ``cache.prefetch`` starts moving the blocks other replicas (or the disk)
hold, and the request is admitted when ``cache.prefetch_ready`` says nothing of it is
still on the way — its disk reads done on every rank, its remote blocks landed or given
up after ``distributed.remote.fetch_timeout_ms``. The cache agrees that answer inside
the TP group at step boundaries, so every rank of a replica admits the same requests in
the same step, and no step blocks on a read (vLLM v1's asynchronous KV loads: a request
waits a step for its external blocks instead of the engine waiting for them).

Blocks of a replica on this node are not waited for: ``cache.prefetch`` starts nothing
for a request whose remote blocks all come from one (``RemoteTier.near``), so the gate
admits it in the step it became runnable and ``add_sequence`` fetches them straight
into its GPU slots by DMA — as fast as onboarding host hits, and running ahead, while
the previous step's forward pass runs. Fetches from other nodes (MPI messages) and
disk reads keep the gate.

The main job also looks ahead (``PrefetchGate.prefetch`` for the requests next in
line, before their GPU blocks can be reserved): a request is prefetched once, whichever
comes first."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Protocol

from .workload import Request


class Prefetching(Protocol):
    """What the gate needs from the cache."""

    def prefetch(self, seq_id: Hashable, tokens: Iterable[int]) -> int: ...

    def prefetch_ready(self, seq_id: Hashable) -> bool: ...


class PrefetchGate:
    """An :class:`~kvdist.sim.engine.scheduler.AdmissionGate` over ``cache.prefetch``."""

    def __init__(self, cache: Prefetching):
        self.cache = cache  # the main job's driver hands it its timed front (``TimedCache``)
        self._started: set[int] = set()  # requests prefetched (alike on every rank)
        self._fetching: set[int] = set()  # ... of which had blocks to fetch
        self._held: set[int] = set()  # started requests held back at least one step
        self.prefetched = 0  # requests that had blocks to fetch
        self.held = 0  # requests admitted at least one step late for their prefetch

    def start(self, req: Request) -> None:
        """``req``'s GPU blocks are reserved: prefetch it now (again, if the look-ahead
        did earlier: its blocks may have gone colder since)."""
        self._started.add(req.rid)
        self._fetch(req)

    def prefetch(self, req: Request) -> None:
        """The look-ahead: start ``req``'s prefetch, unless it was started already."""
        if req.rid not in self._started:
            self._started.add(req.rid)
            self._fetch(req)

    def _fetch(self, req: Request) -> None:
        if self.cache.prefetch(req.rid, req.prompt.tolist()) > 0 and req.rid not in self._fetching:
            self._fetching.add(req.rid)
            self.prefetched += 1

    def ready(self, started: list[Request]) -> set[int]:
        self._held &= {req.rid for req in started}  # admitted ones are gone for good
        out = set()
        for req in started:
            if self.cache.prefetch_ready(req.rid):
                out.add(req.rid)
            elif req.rid not in self._held:
                self._held.add(req.rid)
                self.held += 1
        return out
