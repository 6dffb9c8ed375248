"""Executors for a cache whose GPU tier lives in host memory (``device: cpu``):
the copy kernels, and the executor that runs each batch at once."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from ..storage import DiskPool, GpuPool, HostPool
from .contract import TIMED, Event, ExecutorCounters, Timing
from .routes import DEMOTE, OFFLOAD, ONBOARD, PROMOTE, RELOAD, SPILL, Route

__all__ = ["DONE", "BatchLog", "Copies", "HostCopies", "NullExecutor", "SyncExecutor"]

# Tests: each submitted batch as (route name, tier-local sources, tier-local destinations).
BatchLog = list[tuple[str, list[int], list[int]]]


class Copies(Protocol):
    """The copies a CPU executor runs: ``HostCopies`` (kvdist's own GPU tier) or
    ``kvdist.external.ExternalCopies`` (the engine's tensors)."""

    @property
    def block_bytes(self) -> int: ...

    def run(self, route: Route, src: list[int], dst: list[int], vectorized: bool) -> None:
        """The copies ``src[i] -> dst[i]`` (tier-local slots) of one batch."""

    def run_span(self, route: Route, src: list[int], dst: list[int], span: tuple[int, int]) -> None:
        """Bytes ``span`` of each block only (OFFLOAD and ONBOARD by layer group)."""


class HostCopies:
    """Block copies between the tiers when every tier is CPU-addressable, one handler
    per route. ``run`` applies the copies of one batch in the order given."""

    def __init__(self, gpu: GpuPool, host: HostPool | None, disk: DiskPool | None):
        self.gpu, self.host, self.disk = gpu, host, disk
        self._handlers: dict[Route, Callable[[list[int], list[int], bool], None]] = {
            OFFLOAD: self._offload, ONBOARD: self._onboard, DEMOTE: self._demote,
            SPILL: self._spill, RELOAD: self._reload, PROMOTE: self._promote}

    @property
    def block_bytes(self) -> int:
        return self.gpu.layout.bytes_per_block

    def run(self, route: Route, src: list[int], dst: list[int], vectorized: bool) -> None:
        self._handlers[route](src, dst, vectorized)

    def run_span(self, route: Route, src: list[int], dst: list[int], span: tuple[int, int]) -> None:
        """Bytes ``span`` of each block only (one layer group), in the order given
        (OFFLOAD and ONBOARD: the routes between the GPU and the host tier)."""
        a, b = (self.gpu.raw, self.host.raw) if route is OFFLOAD else (self.host.raw, self.gpu.raw)
        assert route in (OFFLOAD, ONBOARD), f"{route} is not copied by layer group"
        lo, hi = span
        for s, d in zip(src, dst):
            b[d, lo:hi].copy_(a[s, lo:hi])

    @staticmethod
    def _rows(a: torch.Tensor, b: torch.Tensor, src: list[int], dst: list[int], vectorized: bool) -> None:
        if vectorized:
            b.index_copy_(0, torch.tensor(dst), a.index_select(0, torch.tensor(src)))
        else:
            for s, d in zip(src, dst):
                b[d].copy_(a[s])

    def _offload(self, src: list[int], dst: list[int], vectorized: bool) -> None:
        self._rows(self.gpu.raw, self.host.raw, src, dst, vectorized)

    def _onboard(self, src: list[int], dst: list[int], vectorized: bool) -> None:
        self._rows(self.host.raw, self.gpu.raw, src, dst, vectorized)

    # One batched call each: the disk pool spreads it over its I/O threads.
    def _demote(self, src: list[int], dst: list[int], vectorized: bool) -> None:
        h = self.host.raw
        self.disk.write_blocks(dst, [h[s] for s in src])

    def _spill(self, src: list[int], dst: list[int], vectorized: bool) -> None:
        g = self.gpu.raw
        self.disk.write_blocks(dst, [g[s] for s in src])

    def _reload(self, src: list[int], dst: list[int], vectorized: bool) -> None:
        g = self.gpu.raw
        self.disk.read_blocks(src, [g[d] for d in dst])

    def _promote(self, src: list[int], dst: list[int], vectorized: bool) -> None:
        h = self.host.raw
        self.disk.read_blocks(src, [h[d] for d in dst])


class _Done:
    """The event of work that has already run."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DONE"


DONE = _Done()


class SyncExecutor:
    """Runs every batch the moment it is submitted; every event is already complete."""

    path = "sync"
    simulated_compute = None

    compute_wait_seconds = 0.0  # compute is the host: it never waits for a copy
    layered = False  # every copy is done when submitted
    background_disk = False  # disk I/O runs inside submit

    def __init__(self, copies: Copies, log: BatchLog | None = None):
        self.copies = copies
        self.log = log
        self.counters = ExecutorCounters()
        self._timings: list[Timing] = []

    def submit(self, route: Route, src: np.ndarray, dst: np.ndarray, deps: list[Event]) -> Event:
        s, d = np.asarray(src).tolist(), np.asarray(dst).tolist()
        if self.log is not None:
            self.log.append((route.name, s, d))
        t0 = time.perf_counter()
        self.copies.run(route, s, d, vectorized=True)
        if route in TIMED:
            self._timings.append((route, len(s) * self.copies.block_bytes, time.perf_counter() - t0))
        return DONE

    def take_timings(self) -> list[Timing]:
        out, self._timings = self._timings, []
        return out

    def record_compute(self) -> Event | None:
        return None

    def compute_wait(self, events: list[Event], layered: bool = False) -> None:
        pass

    def wait_layer(self, layer: int) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_host(self, events: list[Event]) -> None:
        """The host waits for ``events`` (all complete here)."""

    @staticmethod
    def is_done(event: Event | None) -> bool:
        return True

    @staticmethod
    def holds_host(event: Event | None) -> bool:
        return False

    @staticmethod
    def poll(events: list[Event]) -> bool:
        return True

    def stats(self) -> dict[str, object]:
        return {"path": self.path}

    def close(self) -> None:
        pass


class NullExecutor(SyncExecutor):
    """Copies nothing, every event complete at once: the bookkeeping alone (benchmarks
    and reference-model tests of the manager, with no memory behind the slots)."""

    path = "none"

    def __init__(self) -> None:
        super().__init__(copies=None)

    def submit(self, route: Route, src: np.ndarray, dst: np.ndarray, deps: list[Event]) -> Event:
        return DONE
