"""How a staged host buffer reaches the device (the ``Upload`` contract), one class per
kind of executor; ``kvdist.backend`` builds the one that matches the cache's executor.

Each returns ``(device tensor, marker)`` for a copy it has *queued* (not necessarily
run), and knows whether a marker is complete and how to wait for it. The stager owns
the host buffers and decides, from the markers, when a buffer may be written again
(rule S3)."""

from __future__ import annotations

import ctypes
from typing import Protocol

import numpy as np
import torch

from .. import cudart
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


_TYPESTR = {torch.uint8: "|u1", torch.int8: "|i1", torch.int16: "<i2", torch.int32: "<i4", torch.int64: "<i8",
            torch.float16: "<f2", torch.float32: "<f4", torch.float64: "<f8", torch.bool: "|b1"}


class _Mapped:
    """A CUDA view of pinned host memory: under unified addressing a page-locked
    buffer's host address is also its device address."""

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = {"shape": (t.numel() * t.element_size(),), "typestr": "|u1",
                                         "data": (t.data_ptr(), False), "version": 3}


def _unified_addressing(device: torch.device) -> bool:
    """Whether pinned host memory has the same address on ``device`` (the CUDA runtime's
    cudaDevAttrUnifiedAddressing)."""
    lib, _ = cudart.load()
    if lib is None:
        return False
    value = ctypes.c_int(0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return lib.cudaDeviceGetAttribute(ctypes.byref(value), 41, index) == 0 and value.value == 1


class CudaH2D:
    """Copies from pinned memory on a CUDA stream (the current stream unless one is
    given: the stream whose kernels read the table), each followed by an event. The
    copy is a small kernel reading the pinned buffer through its device mapping (the
    default), not a DMA: a DMA on the compute stream queues behind the onboard stream's
    batches on the host->device copy engine, so a step the scheduler ran ahead of would
    wait for the next step's copies before its first kernel (19 ms of 64 on the H200,
    scripts/gpu/runahead_probe.py). ``zero_copy=False``: the DMA. The slot's event is
    re-recorded rather than created anew, so a steady step creates no CUDA objects."""

    path = "cuda"
    pinned = True

    def __init__(self, device: torch.device, zero_copy: bool = True):
        self.device = device
        self.zero_copy = zero_copy and _unified_addressing(device)

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def to_device(self, src: torch.Tensor, stream=None, reuse=None):
        stream = torch.cuda.current_stream(self.device) if stream is None else stream
        with torch.cuda.stream(stream):  # allocated on that stream: reuse follows its kernels
            if self.zero_copy and src.numel():
                assert src.is_contiguous() and src.dtype in _TYPESTR, f"cannot stage {src.dtype} {src.shape}"
                mapped = torch.as_tensor(_Mapped(src), device=self.device)
                dst = torch.empty(mapped.shape, dtype=torch.uint8, device=self.device)
                torch.bitwise_or(mapped, 0, out=dst)  # an SM kernel reads the pinned bytes
                dst = dst.view(src.dtype).view(src.shape)
            else:
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
