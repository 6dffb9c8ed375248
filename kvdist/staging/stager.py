"""The stager: every per-step host→device metadata copy (block tables, gather
indices, scratch) goes through a ring of host buffers, pinned where CUDA exists,
each guarded by the marker of the last copy out of it (rule S3).

A stage takes the next slot of the ring. The slot is written only once the copy that
last read it has run; if it has not (the scheduler is more slots ahead of the device
than the ring is deep), the host waits for that copy — counted as a ring wait — and
never reuses the buffer silently. A slot too small for a batch is replaced by a larger
one (counted as a pinned allocation); the old buffer stays alive until its copy has
run (the copy holds it). So a steady step allocates nothing and never waits.

``protect=False`` is the bug S3 forbids, kept so tests can show that it corrupts:
one persistent buffer, rewritten by the next stage whether or not its copy has run."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..dtypes import torch_dtype_of
from .uploads import Upload

DEFAULT_SLOTS = 4  # two steps in flight (one ahead), two stages per step
MIN_SLOT_BYTES = 4096


@dataclass(slots=True)
class StagingStats:
    stages: int = 0
    bytes_staged: int = 0
    pinned_allocs: int = 0  # host buffers allocated (pinned when the path is pinned)
    pinned_bytes: int = 0  # bytes the ring holds now
    ring_waits: int = 0  # stages whose slot was still being copied: the host waited
    host_syncs: int = 0  # times the stager blocked the host on the device (waits + synchronize)


@dataclass(slots=True)
class _Slot:
    buf: torch.Tensor | None = None  # uint8 host memory
    host: np.ndarray | None = None  # the same memory, for numpy writers
    marker: object = None  # completion of the last copy out of buf
    views: tuple | None = None  # (shape, dtype, host view, tensor view) of the last stage


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class Stager:
    """A ring of ``slots`` host buffers feeding non-blocking copies; see the module
    docstring. Two ways to stage: ``stage(array)``, or ``host_buffer`` then fill it
    in place (no intermediate array) then ``upload_buffer``."""

    def __init__(self, upload: Upload, *, slots: int = DEFAULT_SLOTS,
                 protect: bool = True):
        assert slots >= 1, f"a ring needs at least one slot, got {slots}"
        self.upload = upload
        self.protect = protect
        self._slots = [_Slot() for _ in range(slots if protect else 1)]
        self._next = 0
        self._open: tuple[_Slot, torch.Tensor, np.ndarray] | None = None
        self.counters = StagingStats()

    # -- staging ----------------------------------------------------------------------------
    def host_buffer(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A host array of ``shape``/``dtype`` in the next ring slot, free to write until
        ``upload_buffer``. Waits (counted) if the slot's last copy has not run yet."""
        assert self._open is None, "host_buffer called twice without upload"
        dtype = np.dtype(dtype)
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        slot = self._slots[self._next]
        if self.protect and not self.upload.is_done(slot.marker):
            self.counters.ring_waits += 1
            self.counters.host_syncs += 1
            self.upload.wait(slot.marker)
        if slot.buf is None or slot.buf.numel() < nbytes:
            self._grow(slot, nbytes)
        views = slot.views
        if views is None or views[0] != shape or views[1] != dtype:  # a batch keeps its shape
            views = slot.views = (shape, dtype, slot.host[:nbytes].view(dtype).reshape(shape),
                                  slot.buf[:nbytes].view(torch_dtype_of(dtype)).view(shape))
        host, src = views[2], views[3]
        self._open = (slot, src, host)
        return host

    def upload_buffer(self, host: np.ndarray, stream=None) -> torch.Tensor:
        """Queue the copy of the array ``host_buffer`` returned; the device tensor is
        valid on ``stream`` (the compute stream by default) once the copy runs there."""
        assert self._open is not None and self._open[2] is host, \
            "upload_buffer needs the array of the last host_buffer call"
        slot, src, _ = self._open
        self._open = None
        dev, slot.marker = self.upload.to_device(src, stream, slot.marker)
        self._next = (self._next + 1) % len(self._slots)
        self.counters.stages += 1
        self.counters.bytes_staged += host.nbytes
        return dev

    def stage(self, array: np.ndarray, stream=None) -> torch.Tensor:
        """A device copy of ``array``; the caller may rewrite ``array`` at once."""
        host = self.host_buffer(array.shape, array.dtype)
        host[...] = array
        return self.upload_buffer(host, stream)

    def _grow(self, slot: _Slot, nbytes: int) -> None:
        old = 0 if slot.buf is None else slot.buf.numel()
        size = _round_up(max(MIN_SLOT_BYTES, 2 * old, nbytes + nbytes // 2), MIN_SLOT_BYTES)
        # The old buffer may still feed a queued copy (protect=False); that copy keeps a
        # reference to it, so dropping ours never frees memory under a copy.
        slot.buf = self.upload.alloc(size)
        slot.host = slot.buf.numpy()
        slot.views = None
        self.counters.pinned_allocs += 1
        self.counters.pinned_bytes += size - old

    # -- waiting -----------------------------------------------------------------------------
    def in_flight(self) -> int:
        """Slots whose last copy has not run yet."""
        return sum(not self.upload.is_done(s.marker) for s in self._slots)

    def synchronize(self) -> None:
        """Block until every queued staging copy has run."""
        for s in self._slots:
            if not self.upload.is_done(s.marker):
                self.counters.host_syncs += 1
                self.upload.wait(s.marker)

    def close(self) -> None:
        """Drop the ring. Queued copies keep their buffers alive until they run."""
        self._open = None
        self._slots = [_Slot() for _ in self._slots]
        self.counters.pinned_bytes = 0

    # -- observability -------------------------------------------------------------------------
    def stats(self) -> dict:
        c = self.counters
        return {"path": self.upload.path, "pinned": self.upload.pinned, "protect": self.protect,
                "slots": len(self._slots), "stages": c.stages, "bytes_staged": c.bytes_staged,
                "pinned_allocs": c.pinned_allocs, "pinned_bytes": c.pinned_bytes,
                "ring_waits": c.ring_waits, "host_syncs": c.host_syncs, "in_flight": self.in_flight()}

    def check_invariants(self) -> None:
        held = sum(0 if s.buf is None else s.buf.numel() for s in self._slots)
        counted = self.counters.pinned_bytes
        assert held == counted, f"ring holds {held} B, counted {counted}"
        assert 0 <= self._next < len(self._slots), f"next slot {self._next} out of range"
        for s in self._slots:
            assert (s.buf is None) == (s.host is None), "a slot's tensor and array disagree"
            if s.buf is not None:
                assert s.host.ctypes.data == s.buf.data_ptr(), "a slot's array is not its tensor's memory"
                assert not self.upload.pinned or s.buf.is_pinned(), "a ring buffer is not pinned"

