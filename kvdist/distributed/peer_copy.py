"""Copies out of a peer replica's mapped host tier, one variant per kind of copy
machinery, chosen once when the remote tier is built (``make_copier``, from the same
device and setting that chose the cache's executor in ``kvdist.backend``):

=====================  ==============================================================
``ImmediateCopier``    CPU cache: the host waits for the landing slots' pending copies
                       (S2), then copies at once
``SimulatedCopier``    CPU cache, simulated streams: queued on the "remote" stream
                       after those copies; runs when polled, unless the stream is held
                       (a test knob gives it a bandwidth: ``KVDIST_SIM_REMOTE_GBPS``)
``CudaCopier``         into the GPU tier: a batched DMA on a stream of its own that
                       first waits for them on the GPU; into the host tier: memcpys
                       split over a few worker threads once the host has waited for them
=====================  ==============================================================

Each returns a ``CopyOp``: whether the copy has run, when it began (a copy waiting its
turn behind earlier ones has not: the fetch's deadline counts from its start), and
whether it can still be stopped (only a queued simulated copy can: a DMA or memcpy
under way always runs)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np
import torch

__all__ = ["HOST_COPY_THREADS", "CopyOp", "CudaCopier", "ImmediateCopier", "PeerCopier", "SimulatedCopier",
           "make_copier", "sim_rates"]

HOST_COPY_THREADS = 4  # a CUDA rank's memcpy workers for landings in its host tier
_ROWS_PER_THREAD = 8  # at least this many blocks a worker (fewer: fewer workers)


def _copy_rows(dst: np.ndarray, src: np.ndarray, pairs: list[tuple[int, int]]) -> None:
    """``dst[b] = src[a]`` for every pair: one memcpy a block (numpy's row copies run at
    memory speed; torch's ``index_select``/``index_copy_`` on uint8 rows does not)."""
    for a, b in pairs:
        dst[b] = src[a]


class CopyOp(Protocol):
    def done(self) -> bool:
        """Whether the copy has run (a simulated one is run now unless its stream is held)."""

    def began(self) -> float | None:
        """When the copy began moving bytes (``time.monotonic``); None while it waits its
        turn behind this rank's earlier copies, or for the landing slots' pending copies."""

    def cancel(self) -> bool:
        """Stop the copy if it has not run; True when it will never write."""


class PeerCopier(Protocol):
    def start(self, src: torch.Tensor, dst: torch.Tensor, s_idx: np.ndarray, d_idx: np.ndarray,
              deps: list, to_gpu: bool, src_chunk: int = 0) -> CopyOp:
        """Copy ``src[s_idx] -> dst[d_idx]`` (uint8 ``[blocks, bytes]``; ``dst`` is the GPU
        tier when ``to_gpu``) after ``deps``, the landing slots' pending events (S2)."""

    def close(self) -> None:
        """Wait for every copy started (none may read a mapping after this)."""


class HostWaiter(Protocol):
    def wait_host(self, events: list) -> None: ...


class _Ran:
    """A copy that ran inside ``start``."""

    __slots__ = ("at",)

    def __init__(self, at: float):
        self.at = at

    def done(self) -> bool:
        return True

    def began(self) -> float | None:
        return self.at

    def cancel(self) -> bool:
        return True


class ImmediateCopier:
    def __init__(self, executor: HostWaiter):
        self.executor = executor

    def start(self, src, dst, s_idx, d_idx, deps, to_gpu, src_chunk=0) -> CopyOp:
        self.executor.wait_host(deps)
        at = time.monotonic()
        _copy_rows(dst.numpy(), src.numpy(), list(zip(s_idx.tolist(), d_idx.tolist())))
        return _Ran(at)

    def close(self) -> None:
        pass


class SimStreams(Protocol):
    """A ``SimExecutor``'s streams (``kvdist.transfer.simulated``)."""

    streams: dict

    def enqueue(self, stream: str, fn: Callable[[], None], deps: list | None = None): ...
    def force(self, op) -> None: ...


class _Queued:
    """A copy on the simulated "remote" stream (see ``SimulatedCopier``)."""

    __slots__ = ("at", "cancelled", "executor", "op", "ready")

    def __init__(self, executor: SimStreams):
        self.executor, self.op, self.cancelled = executor, None, False
        self.at: float | None = None  # when it began (its modelled turn came)
        self.ready = 0.0  # when it counts as done (modelled bandwidth)

    def done(self) -> bool:
        if not self.op.done and not self.executor.streams["remote"].held:
            self.executor.force(self.op)
        return self.op.done and (self.ready <= 0.0 or time.monotonic() >= self.ready)

    def began(self) -> float | None:
        return self.at if self.op.done else None

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def sim_rates() -> dict[bool, float]:
    """``KVDIST_SIM_REMOTE_GBPS`` = ``HOST,GPU``: the simulated remote stream's modelled
    bandwidth (GB/s) into the host tier and into the GPU tier (a simulation's knob, for
    comparing landing paths on a CPU at a GPU host's ratios; unset: copies take no time)."""
    spec = os.environ.get("KVDIST_SIM_REMOTE_GBPS", "")
    if not spec:
        return {}
    host, gpu = (float(x) for x in spec.split(","))
    return {False: host * 1e9, True: gpu * 1e9}


class SimulatedCopier:
    """Copies queued on the simulated "remote" stream. With modelled ``rates`` (bytes/s by
    whether the copy lands in the GPU tier) each destination is a FIFO channel: a copy
    begins when it ran on the stream and the copies before it are done, and counts as
    done once its bytes at that rate have passed (its bytes are written when it runs;
    the stamps are read again only then, R2)."""

    def __init__(self, executor: SimStreams, rates: dict[bool, float] | None = None):
        self.executor = executor
        self.rates = rates or {}
        self._free = {False: 0.0, True: 0.0}  # when each channel is free again

    def start(self, src, dst, s_idx, d_idx, deps, to_gpu, src_chunk=0) -> CopyOp:
        pairs = list(zip(s_idx.tolist(), d_idx.tolist()))[::-1]  # no order inside a batch
        q = _Queued(self.executor)
        rate = self.rates.get(to_gpu, 0.0)
        nbytes = len(pairs) * (dst.shape[1] if dst.dim() > 1 else 0)

        def run() -> None:
            q.at = now = time.monotonic()
            if rate > 0:
                q.at = max(now, self._free[to_gpu])
                q.ready = self._free[to_gpu] = q.at + nbytes / rate
            if not q.cancelled:
                _copy_rows(dst.numpy(), src.numpy(), pairs)
        q.op = self.executor.enqueue("remote", run, deps)
        return q

    def close(self) -> None:
        pass  # a queued copy runs only when forced; cancelled ones never write


class CudaStreams(HostWaiter, Protocol):
    """A ``CudaExecutor`` (``kvdist.transfer.cuda``): its batched copier, and a stream's
    wait for its events."""

    copier: object

    def stream_wait(self, stream: torch.cuda.Stream, events: list) -> None: ...


class _OnGpu:
    """A DMA on the copier's stream: it began once the event recorded before it (after
    the landing slots' pending copies) completed, as first seen by a poll."""

    __slots__ = ("at", "before", "event")

    def __init__(self, before, event):
        self.before, self.event, self.at = before, event, None

    def done(self) -> bool:
        return self.event.query()

    def began(self) -> float | None:
        if self.at is None and self.before.query():
            self.at = time.monotonic()
        return self.at

    def cancel(self) -> bool:
        return False


class _OnThreads:
    """Row copies split over the worker threads; began when the first part did."""

    __slots__ = ("futures", "starts")

    def __init__(self, futures: list[Future], starts: list[float]):
        self.futures, self.starts = futures, starts

    def done(self) -> bool:
        if all(f.done() for f in self.futures):
            for f in self.futures:
                f.result()  # a worker's error surfaces here
            return True
        return False

    def began(self) -> float | None:
        return min(self.starts, default=None)

    def cancel(self) -> bool:
        return False


def _part(starts: list[float], dst: np.ndarray, src: np.ndarray, pairs: list[tuple[int, int]]) -> None:
    starts.append(time.monotonic())  # list.append is atomic: parts start on several threads
    _copy_rows(dst, src, pairs)


class CudaCopier:
    """Into the GPU tier: one batched DMA per fetch on the copier's own stream. Into the
    host tier: numpy row copies (they release the GIL) split over ``threads`` workers,
    ``_ROWS_PER_THREAD`` blocks at least each; fetches queue behind each other, FIFO."""

    def __init__(self, executor: CudaStreams, device: torch.device, threads: int = HOST_COPY_THREADS):
        self.executor = executor
        self.stream = torch.cuda.Stream(device)
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(threads,
                                                                   thread_name_prefix="kvdist-remote")

    def start(self, src, dst, s_idx, d_idx, deps, to_gpu, src_chunk=0) -> CopyOp:
        if to_gpu:
            self.executor.stream_wait(self.stream, deps)
            before = torch.cuda.Event()
            before.record(self.stream)
            self.executor.copier.copy(self.stream, src, dst, s_idx, d_idx, src_chunk=src_chunk)
            ev = torch.cuda.Event()
            ev.record(self.stream)
            return _OnGpu(before, ev)
        self.executor.wait_host(deps)
        pairs = list(zip(s_idx.tolist(), d_idx.tolist()))
        k = max(1, min(self.threads, len(pairs) // _ROWS_PER_THREAD))
        d, s = dst.numpy(), src.numpy()
        starts: list[float] = []
        futures = [self._pool.submit(_part, starts, d, s, pairs[i::k]) for i in range(k)]
        return _OnThreads(futures, starts)

    def close(self) -> None:
        self.stream.synchronize()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def make_copier(device: torch.device, simulated: bool, executor) -> PeerCopier:
    """The variant for a cache on ``device`` (``simulated``: its CPU executor runs
    simulated streams), over that cache's ``executor``."""
    if device.type == "cuda":
        return CudaCopier(executor, device)
    return SimulatedCopier(executor, sim_rates()) if simulated else ImmediateCopier(executor)
