"""What the transfer engine asks of an executor, the part that does the copies and owns
the streams and events. Three implement it: ``SyncExecutor`` (copies at once, CPU),
``SimExecutor`` (simulated asynchronous streams, CPU) and ``CudaExecutor`` (CUDA
streams, disk worker threads). ``kvdist.backend`` picks one per cache.

An event is whatever the executor returns for a batch; the engine only hands events
back to the same executor (as dependencies, to ``compute_wait``, to ``is_done``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .routes import ONBOARD, PROMOTE, RELOAD, Route

__all__ = ["TIMED", "Event", "Executor", "ExecutorCounters", "SimulatedCompute", "Timing"]

Event = object  # opaque to everyone but the executor that made it
Timing = tuple[Route, int, float]  # (route, bytes copied, seconds the copy took)
TIMED = (ONBOARD, RELOAD, PROMOTE)  # routes whose copy times the executors report (onboard or recompute)


@dataclass(slots=True)
class ExecutorCounters:
    """Where the host blocked on disk work (the CUDA executor's disk workers; zero for
    the others, whose disk I/O runs inside the call that queues it)."""

    host_waits: int = 0  # times the host blocked on unfinished disk work
    host_wait_seconds: float = 0.0
    host_wait_read_seconds: float = 0.0  # of which on disk reads (reloads); the rest on writes
    disk_batches: int = 0


class SimulatedCompute(Protocol):
    """The compute stream of a CPU cache with simulated streams: an engine's forward pass
    is queued on it as a kernel (behind the block table's copy) and forced to run."""

    def kernel(self, fn: Callable[[], None]) -> Event:
        """Queue ``fn`` on the simulated compute stream; returns its event."""
        ...

    def force(self, event: Event) -> None:
        """Run the queued work ``event`` stands for, and everything it follows, now."""
        ...


class Executor(Protocol):
    path: str  # what runs the copies: "sync", "simulated", "none", or the CUDA copy path
    counters: ExecutorCounters
    simulated_compute: SimulatedCompute | None  # only with simulated streams
    layered: bool  # GPU<->host batches go by layer group: compute waits per layer (S5)
    compute_wait_seconds: float  # time the compute stream stood still at compute_wait
    # Disk batches run on after ``submit`` returns (CUDA's workers, simulated streams): a
    # scheduler waits a step for a prefetch's reads (``kvdist.loads``) rather than block on
    # them. False where ``submit`` itself does the I/O: nothing is ever left to wait for.
    background_disk: bool

    def submit(self, route: Route, src: np.ndarray, dst: np.ndarray, deps: list[Event]) -> Event:
        """Queue the copies ``src[i] -> dst[i]`` (int64 tier-local slots) of one batch
        on ``route.stream``, to run after *all* of the batches and compute work of
        ``deps``, including dependencies this batch does not itself need (two reads of
        one slot): the engine keeps one read entry per slot and relies on a batch having
        waited for the reads before it. Copies of one batch have no order among
        themselves."""
        ...

    def record_compute(self) -> Event | None:
        """An event for the compute stream's work so far (rule S4); None if none is pending."""
        ...

    def compute_wait(self, events: list[Event], layered: bool = False) -> None:
        """The compute stream waits for ``events`` (rule S5) — now, or (``layered``)
        layer by layer: each ``wait_layer(layer)`` then waits for the layer group of
        these batches holding that layer."""
        ...

    def wait_layer(self, layer: int) -> None:
        """The compute stream waits for ``layer``'s group of the batches of the last
        ``compute_wait(events, layered=True)`` (rule S5, one layer)."""
        ...

    def take_timings(self) -> list[Timing]:
        """The TIMED copies completed since the last call (for the onboard-or-recompute
        policy): an onboard's time is its copy's, a reload's its disk read's."""
        ...

    def synchronize(self) -> None:
        """The host waits until every submitted batch has run."""
        ...

    def is_done(self, event: Event | None) -> bool:
        """Whether ``event``'s work has run (None: nothing to wait for)."""
        ...

    def holds_host(self, event: Event | None) -> bool:
        """Whether a copy queued now after ``event`` would make the host wait for it:
        disk work still running (a CUDA stream cannot wait for a disk worker)."""
        ...

    def poll(self, events: list[Event]) -> bool:
        """Whether all of ``events``' work has run, never blocking the host. A lazy
        executor (simulated streams) runs it now, unless something it needs is held:
        a scheduler polling for a load is the moment it is wanted."""
        ...

    def wait_host(self, events: list[Event]) -> None:
        """The host waits until the work of ``events`` has run (before memory the
        executor does not see — an MPI receive — writes the slots they touch)."""
        ...

    def stats(self) -> dict[str, object]:
        """``path`` and the executor's own counters (``KVCache.stats()["transfer"]``)."""
        ...

    def close(self) -> None:
        """Release threads and streams (after ``synchronize``; idempotent)."""
        ...
