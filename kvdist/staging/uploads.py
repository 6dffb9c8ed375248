"""How a staged host buffer reaches the device (the ``Upload`` contract), one class per
kind of executor; ``kvdist.backend`` builds the one that matches the cache's executor.

Each returns ``(device tensor, marker)`` for a copy it has *queued* (not necessarily
run), and knows whether a marker is complete and how to wait for it. The stager owns
the host buffers and decides, from the markers, when a buffer may be written again
(rule S3)."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from ..transfer.simulated import SimExecutor

__all__ = ["POISON", "CudaH2D", "ImmediateH2D", "SimH2D", "Upload"]


class Upload(Protocol):
    path: str  # "cuda", "simulated" or "immediate"
    pinned: bool  # whether ``alloc`` gives page-locked memory

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of ``nbytes`` that copies can read from."""
        ...

    def to_device(self, src: torch.Tensor, stream=None, reuse=None) -> tuple[torch.Tensor, object]:
        """Queue the copy of ``src`` to the device (on ``stream``, the compute stream by
        default); returns the device tensor and the copy's marker (``reuse``: the
        previous marker of the same buffer, which may be recycled)."""
        ...

    def is_done(self, marker) -> bool:
        """Whether the copy ``marker`` stands for has run (None: no copy)."""
        ...

    def wait(self, marker) -> None:
        """Block the host until that copy has run."""
        ...


def _cpu_empty(like: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    # numpy's allocator recycles freed memory; torch's CPU allocator maps fresh pages for
    # every tensor over 128 KiB (a block table of 256 x 128), which costs more than the copy.
    # Copies go through numpy too: torch splits a copy that size over its thread pool, whose
    # wake-up costs milliseconds on a busy machine.
    arr = np.empty_like(like)
    return torch.from_numpy(arr), arr


class CudaH2D:
    """Non-blocking copies from pinned memory on a CUDA stream (the current stream
    unless one is given: the stream whose kernels read the table), each followed by an
    event. The slot's event is re-recorded rather than created anew, so a steady step
    creates no CUDA objects."""

    path = "cuda"
    pinned = True

    def __init__(self, device: torch.device):
        self.device = device

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def to_device(self, src: torch.Tensor, stream=None, reuse=None):
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
            dst = src.to(self.device, non_blocking=True)
        else:  # allocate on that stream too, so the allocator orders reuse after its kernels
            with torch.cuda.stream(stream):
                dst = src.to(self.device, non_blocking=True)
        event = reuse if isinstance(reuse, torch.cuda.Event) else torch.cuda.Event()
        event.record(stream)
        return dst, event

    @staticmethod
    def is_done(marker) -> bool:
        return marker is None or marker.query()

    @staticmethod
    def wait(marker) -> None:
        marker.synchronize()


# Bytes a simulated device tensor holds until its copy has run: int32 -1515870811, an
# index no table holds, so a table read before its copy ran is visibly wrong.
POISON = 0xA5


class SimH2D:
    """The copy as an operation on a simulated stream (``compute`` unless named). On a
    CPU the host is the compute stream: a CPU engine reads the table as soon as
    ``block_table`` returns, so the copy runs at once (with whatever it follows) unless
    that stream is held. A test that holds it keeps the copy queued, reading the host
    buffer only when something forces it, so a buffer rewritten before then shows up
    as wrong bytes (the CPU model of a GPU running behind: rule S3's race tests); so
    does an executor that ``runs_behind``."""

    path = "simulated"
    pinned = False

    def __init__(self, executor: SimExecutor, stream: str = "compute"):
        self.executor = executor
        self.stream = stream

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.from_numpy(np.empty(nbytes, dtype=np.uint8))

    def to_device(self, src: torch.Tensor, stream=None, reuse=None):
        host = src.numpy()
        dst, arr = _cpu_empty(host)
        arr.view(np.uint8).fill(POISON)
        name = self.stream if stream is None else stream
        op = self.executor.enqueue(name, lambda: np.copyto(arr, host))
        if not (self.executor.streams[name].held or self.executor.runs_behind):
            self.executor.force(op)
        return dst, op

    @staticmethod
    def is_done(marker) -> bool:
        return marker is None or marker.done

    def wait(self, marker) -> None:
        self.executor.force(marker)


class ImmediateH2D:
    """A CPU 'device' without simulation: the copy is done on return."""

    path = "immediate"
    pinned = False

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.from_numpy(np.empty(nbytes, dtype=np.uint8))

    def to_device(self, src: torch.Tensor, stream=None, reuse=None):
        host = src.numpy()
        dst, arr = _cpu_empty(host)
        np.copyto(arr, host)
        return dst, None

    @staticmethod
    def is_done(marker) -> bool:
        return True

    @staticmethod
    def wait(marker) -> None:
        pass
