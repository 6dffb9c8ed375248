"""Copies out of a peer replica's mapped host tier, one variant per kind of copy
machinery, chosen once when the remote tier is built (``make_copier``, from the same
device and setting that chose the cache's executor in ``kvdist.backend``):

=====================  ==============================================================
``ImmediateCopier``    CPU cache: the host waits for the landing slots' pending copies
                       (S2), then copies at once
``SimulatedCopier``    CPU cache, simulated streams: queued on the "remote" stream
                       after those copies; runs when polled, unless the stream is held
``CudaCopier``         into the GPU tier: a batched DMA on a stream of its own that
                       first waits for them on the GPU; into the host tier: a memcpy on
                       a worker thread once the host has waited for them
=====================  ==============================================================

Each returns a ``CopyOp``: whether the copy has run, and whether it can still be
stopped (only a queued simulated copy can: a DMA or memcpy under way always runs)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np
import torch

__all__ = ["CopyOp", "CudaCopier", "ImmediateCopier", "PeerCopier", "SimulatedCopier", "make_copier"]


def _copy_rows(dst: np.ndarray, src: np.ndarray, pairs: list[tuple[int, int]]) -> None:
    """``dst[b] = src[a]`` for every pair: one memcpy a block (numpy's row copies run at
    memory speed; torch's ``index_select``/``index_copy_`` on uint8 rows does not)."""
    for a, b in pairs:
        dst[b] = src[a]


class CopyOp(Protocol):
    def done(self) -> bool:
        """Whether the copy has run (a simulated one is run now unless its stream is held)."""

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

    __slots__ = ()

    def done(self) -> bool:
        return True

    def cancel(self) -> bool:
        return True


class ImmediateCopier:
    def __init__(self, executor: HostWaiter):
        self.executor = executor

    def start(self, src, dst, s_idx, d_idx, deps, to_gpu, src_chunk=0) -> CopyOp:
        self.executor.wait_host(deps)
        _copy_rows(dst.numpy(), src.numpy(), list(zip(s_idx.tolist(), d_idx.tolist())))
        return _Ran()

    def close(self) -> None:
        pass


class SimStreams(Protocol):
    """A ``SimExecutor``'s streams (``kvdist.transfer.simulated``)."""

    streams: dict

    def enqueue(self, stream: str, fn: Callable[[], None], deps: list | None = None): ...
    def force(self, op) -> None: ...


class _Queued:
    """A copy on the simulated "remote" stream."""

    __slots__ = ("cancelled", "executor", "op")

    def __init__(self, executor: SimStreams):
        self.executor, self.op, self.cancelled = executor, None, False

    def done(self) -> bool:
        if not self.op.done and not self.executor.streams["remote"].held:
            self.executor.force(self.op)
        return self.op.done

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class SimulatedCopier:
    def __init__(self, executor: SimStreams):
        self.executor = executor

    def start(self, src, dst, s_idx, d_idx, deps, to_gpu, src_chunk=0) -> CopyOp:
        pairs = list(zip(s_idx.tolist(), d_idx.tolist()))[::-1]  # no order inside a batch
        q = _Queued(self.executor)

        def run() -> None:
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
    __slots__ = ("event",)

    def __init__(self, event):
        self.event = event

    def done(self) -> bool:
        return self.event.query()

    def cancel(self) -> bool:
        return False


class _OnThread:
    __slots__ = ("future",)

    def __init__(self, future: Future):
        self.future = future

    def done(self) -> bool:
        if self.future.done():
            self.future.result()  # a worker's error surfaces here
            return True
        return False

    def cancel(self) -> bool:
        return False


class CudaCopier:
    def __init__(self, executor: CudaStreams, device: torch.device):
        self.executor = executor
        self.stream = torch.cuda.Stream(device)
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="kvdist-remote")

    def start(self, src, dst, s_idx, d_idx, deps, to_gpu, src_chunk=0) -> CopyOp:
        if to_gpu:
            self.executor.stream_wait(self.stream, deps)
            self.executor.copier.copy(self.stream, src, dst, s_idx, d_idx, src_chunk=src_chunk)
            ev = torch.cuda.Event()
            ev.record(self.stream)
            return _OnGpu(ev)
        self.executor.wait_host(deps)
        pairs = list(zip(s_idx.tolist(), d_idx.tolist()))
        return _OnThread(self._pool.submit(_copy_rows, dst.numpy(), src.numpy(), pairs))

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
    return SimulatedCopier(executor) if simulated else ImmediateCopier(executor)
