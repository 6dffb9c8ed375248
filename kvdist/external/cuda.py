"""The CUDA executor with the engine's tensors as the GPU tier (``cache.gpu: external``).
Everything but the GPU side of a copy is ``CudaExecutor``'s (streams, events, layer
groups, disk workers, bounce buffers, the ordering it is handed); a copy that touches
the engine's blocks moves each block as the engine holds it (``ExternalGpuTier``), one
of three ways:

* ``direct``: every piece is one entry of a batched copy (``cudaMemcpyBatchAsync``)
  between its host bytes and its place in the engine's tensor: ``num_layers x pieces``
  entries a block. The copy engines move small pieces slowly (16-token blocks of an 8B
  model: 64 KiB a layer at TP 1, 8 KiB at TP 8; ``scripts/gpu/piece_probe.py``).
* ``staged``: whole kvdist blocks (their layer group's bytes) are copied between host
  and a device staging buffer at the copy engines' full rate, and one kernel a layer
  group (a layer, where the engine's layers are separate allocations) scatters the
  pieces into the engine's blocks or gathers them out, on a side stream, half the
  buffer at a time so that copies and kernels overlap (``_staged``; the halves take
  turns across batches too); its memory is ``stage_bytes`` a stream, allocated on first
  use. The kernels' engine block ids go to the device once a batch (not once a layer
  group), through a ring of pinned buffers per copy stream: a ring slot still in use
  makes the host wait for that stream's own copies, never for the other direction's.
* ``rows``: where every block's layers are one contiguous run in kvdist's order (vLLM's
  cross-layer, block-outermost layouts), whole blocks, exactly as kvdist's own GPU tier
  moves them: a batched copy of N entries (a layer group's bytes of each block).

``auto`` is ``rows`` where it can be, else ``staged`` when a piece is smaller than
``STAGED_BELOW``, else ``direct``: measured side by side by
``scripts/gpu/external_probe.py`` (H200, 2026-12-01, 1 GiB each way, the engine's
layers allocated one by one, as a fraction of a contiguous pinned copy):

=============  ==============  ===================  ===================
TP (piece)     block           staged off / on      direct off / on
=============  ==============  ===================  ===================
8 (8 KiB)      256 KiB         90% / 92%            19% / 6% (*)
4 (16 KiB)     512 KiB         89% / 94%            52% / 8%
2 (32 KiB)     1 MiB           83% / 85%            89% / 90%
1 (64 KiB)     2 MiB           47–61% / 58%         96% / 96% (*)
=============  ==============  ===================  ===================

(*) an earlier run the same day, as a fraction of ``bench transfer``'s batched copies
of whole blocks of the same size (95–99% of the contiguous copy).

Those staged figures were measured while a layer group's chunk took a whole block's room
a block in the staging buffer (TP 1's 8 groups: 4 MiB chunks, 8 times the chunks and
their host time); a chunk is now as many of the group's spans as half the buffer holds
(``_staged``), not re-measured.

A disk read that fails (an I/O error) in a reload, with ``on_failed`` given, is what it
is on CPU (``kvdist.external.copies``): its GPU half is never queued, so the engine
blocks of that batch keep their bytes, and their ids go to ``on_failed`` (the engine
recomputes them); the step goes on. The batch still ends with an event on the onboard
stream after everything its GPU half would have waited for, so the transfer engine's
ordering of the blocks' later copies (S2) holds as if it had run."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import numpy as np
import torch

from ..layout import LayerGroups
from ..staging import CudaH2D, ImmediateH2D, Stager, Upload
from ..storage import DiskPool, HostPool
from ..transfer.cuda import CudaExecutor, DiskOp
from ..transfer.executors import BatchLog
from ..transfer.routes import ONBOARD, RELOAD, Route
from .tier import ExternalGpuTier

__all__ = ["GATHER_MODES", "STAGED_BELOW", "STAGE_BYTES", "ExternalCudaExecutor"]

GATHER_MODES = ("auto", "rows", "staged", "direct")
INDEX_SLOTS = 32  # staging ring slots for the staged path's block ids (one a layer group a batch)
STAGE_BYTES = 64 << 20  # a stream's staging buffer
STAGED_BELOW = 32 << 10  # auto: pieces smaller than this go through the staging buffer


class ExternalCudaExecutor(CudaExecutor):
    """``CudaExecutor`` over the engine's tensors (see the module docstring)."""

    def __init__(self, gpu: ExternalGpuTier, host: HostPool | None, disk: DiskPool | None,
                 device: torch.device, *, path: str | None = None, disk_threads: int = 2,
                 log: BatchLog | None = None, groups: LayerGroups | None = None, gather: str = "auto",
                 staged_below: int = STAGED_BELOW, stage_bytes: int = STAGE_BYTES,
                 on_failed: Callable[[list[int]], None] | None = None):
        assert gather in GATHER_MODES, f"gather is one of {GATHER_MODES}, not {gather!r}"
        if gather == "auto":
            gather = ("rows" if gpu.rows is not None else
                      "staged" if gpu.pieces_of.piece_bytes < staged_below else "direct")
        assert gather != "rows" or gpu.rows is not None, "the engine's blocks are not whole rows"
        self.gather = gather  # before CudaExecutor asks for _gpu_rows
        self._on_failed = on_failed  # a failed reload's engine blocks (see the module docstring)
        super().__init__(gpu, host, disk, device, path=path, disk_threads=disk_threads, log=log,
                         groups=groups)
        self._stage_blocks = max(2, stage_bytes // self.block_bytes)
        self._stages: dict[int, torch.Tensor] = {}  # by stream
        self._sides: dict[int, torch.cuda.Stream] = {}  # by stream: its scatter and gather kernels
        self._free: dict[int, list] = {}  # by stream: per staging half, the event of its last reader
        self._half: dict[int, int] = {}  # by stream: the staging half its next chunk goes through
        # The engine block ids a staged batch's kernels index by, host -> device (S3): a ring
        # a stream, so a ring slot's wait follows that stream's own copies, never the other
        # direction's; uploaded once a batch (the last upload of each stream is kept for
        # the batch's other layer groups).
        self._upload: Upload = CudaH2D(device) if device.type == "cuda" else ImmediateH2D()
        self._stagers: dict[int, Stager] = {}
        self._ids: dict[int, tuple[np.ndarray, torch.Tensor]] = {}  # by stream: the last upload
        pieces = gpu.pieces_of
        self._offsets = np.array([[pieces.offset(layer, p) for p in range(pieces.per_layer)]
                                  for layer in range(pieces.num_layers)], dtype=np.int64)

    def _gpu_rows(self):
        """The engine's blocks as whole rows (``rows``), else the tier itself: then
        ``_rows_copy`` moves each block piece by piece."""
        return self.gpu.rows if self.gather == "rows" else self.gpu

    def stats(self) -> dict[str, object]:
        return {**super().stats(), "gather": self.gather, "stacked": self.gpu.stacked,
                "one_kernel": self.gpu.one_kernel, "index_uploads": self.index_uploads()}

    # -- a failed disk read --------------------------------------------------------------------
    def _read_task(self, route: Route, deps: list, slots: list[int], rows: list) -> bool:
        """The disk worker's read, as ``CudaExecutor``'s; False (its future's result) when
        a reload's read failed and ``on_failed`` takes its blocks, so no wait on it raises."""
        self._worker_wait(deps)
        t0 = time.perf_counter()
        try:
            self.disk.read_blocks(slots, rows)
        except OSError:
            if route is not RELOAD or self._on_failed is None:
                raise
            return False
        self._timings.append((route, len(slots) * self.block_bytes, time.perf_counter() - t0))
        return True

    def _finish_reload(self, op: DiskOp) -> None:
        """Queue the GPU half of a reload (bounce -> engine blocks, as ``CudaExecutor``'s),
        or, when its read failed, name its engine blocks to ``on_failed`` and stand its GPU
        half for an event on the onboard stream after what the GPU half would have waited
        for: nothing is copied."""
        self._host_wait(op.future, reading=True)
        t0 = time.perf_counter()
        st = self.streams[ONBOARD.stream]
        if op.future.result() is False:
            self._gpu_wait(st, op.gpu_deps, host_tier=False)
            op.gpu_event = self._record(st)
            self._on_failed([int(b) for b in op.gpu_slots])
        else:
            n = len(op.gpu_slots)
            op.gpu_event = self._copy(st, op.buffer[:n], self.gpu_rows, np.arange(n), op.gpu_slots,
                                      op.gpu_deps, host_tier=False)
        op.gpu_deps = []
        self.submit_seconds["reload_gpu_half"] += time.perf_counter() - t0

    def _rows_copy(self, st: torch.cuda.Stream, src_rows, dst_rows, s: np.ndarray, d: np.ndarray,
                   span: tuple[int, int] | None = None, **chunks: int) -> None:
        gpu = self.gpu
        if src_rows is not gpu and dst_rows is not gpu:  # host and bounce rows: as CudaExecutor does
            lo, hi = span if span is not None else (0, self.block_bytes)
            if span is not None:
                src_rows, dst_rows, chunks = src_rows[:, lo:hi], dst_rows[:, lo:hi], {}
            self.copier.copy(st, src_rows, dst_rows, s, d, **chunks)
            return
        to_gpu = dst_rows is gpu
        rows, at, blocks = (src_rows, s, d) if to_gpu else (dst_rows, d, s)
        chunk = chunks.get("src_chunk" if to_gpu else "dst_chunk", 0)
        layers = range(gpu.layout.num_layers) if span is None else gpu.layout.layers_in(span)
        if self.gather == "direct":
            self._direct(st, rows, at, blocks, layers, to_gpu)
        else:
            self._staged(st, rows, at, blocks, layers, span, to_gpu, chunk)

    def _direct(self, st, rows: torch.Tensor, at: np.ndarray, blocks: np.ndarray, layers: range,
                to_gpu: bool) -> None:
        """One batched copy, an entry per piece."""
        engine = self.gpu.piece_pointers(blocks, layers).ravel()
        offs = self._offsets[layers.start:layers.stop][None, :, :]
        host = (rows.data_ptr() + np.asarray(at, dtype=np.int64)[:, None, None] * rows.stride(0)
                + offs).astype(np.uint64).ravel()
        sizes = np.full(len(engine), self.gpu.pieces_of.piece_bytes, dtype=np.uint64)
        dsts, srcs = (engine, host) if to_gpu else (host, engine)
        self.copier.copy_pointers(st, dsts, srcs, sizes)

    def _stage(self, st) -> torch.Tensor:
        buf = self._stages.get(id(st))
        if buf is None:
            buf = torch.empty((self._stage_blocks, self.block_bytes), dtype=torch.uint8, device=self.device)
            self._stages[id(st)] = buf
        return buf

    def _staged(self, st, rows: torch.Tensor, at: np.ndarray, blocks: np.ndarray, layers: range,
                span: tuple[int, int] | None, to_gpu: bool, chunk: int) -> None:
        """Whole blocks (``span`` of each, packed: a chunk is as many spans as half the
        buffer holds, so a layer group's chunk is as large as a whole block's) through the
        stream's staging buffer, half of it a chunk: the copies on ``st``, the kernels that
        scatter or gather the pieces on a side stream of ``st``'s, so the copy of one chunk
        overlaps the kernels of the last. A half is refilled only after the last chunk
        through it was read out of it (an event per half, kept across batches); ``st`` ends
        waiting for the kernels, so the batch's event recorded on it next covers them."""
        stage = self._stage(st).view(-1)
        lo, hi = span if span is not None else (0, self.block_bytes)
        part = (lambda t: t) if span is None else (lambda t: t[:, lo:hi])
        width = hi - lo  # a staged row holds the span alone: a layer group's chunk fills its half
        assert width == len(layers) * self.gpu.layout.bytes_per_layer, f"span {span} is not layers {layers}"
        k = max(1, stage.numel() // 2 // width)
        ids = self._indices(st, blocks)
        side = self._side_stream(st)
        side.wait_stream(st)  # the batch's dependencies (st waited for them) and the ids' upload
        if self.device.type == "cuda":
            ids.record_stream(side)
        free = self._free.setdefault(id(st), [None, None])  # per half: its last reader is done
        h0 = self._half.get(id(st), 0)  # halves alternate across batches too
        for c, i in enumerate(range(0, len(at), k)):
            h = (h0 + c) % 2
            buf = stage[h * k * width:(h + 1) * k * width].view(k, width)
            a = np.asarray(at[i:i + k], dtype=np.int64)
            n = len(a)
            here = np.arange(n, dtype=np.int64)
            idx = ids[i:i + n]
            if to_gpu:
                if free[h] is not None:
                    st.wait_event(free[h])  # the kernels of chunk c - 2 have read this half
                self.copier.copy(st, part(rows), buf, a, here, src_chunk=chunk)
                side.wait_event(self._record(st))
                with self._on(side):
                    self.gpu.scatter(buf[:n], idx, layers, packed=True)
                free[h] = self._record(side)
            else:
                if free[h] is not None:
                    side.wait_event(free[h])  # the copy of chunk c - 2 has read this half
                with self._on(side):
                    self.gpu.stage_out(idx, buf[:n], layers, packed=True)
                st.wait_event(self._record(side))
                self.copier.copy(st, buf, part(rows), here, a, dst_chunk=chunk)
                free[h] = self._record(st)
        chunks = len(range(0, len(at), k))
        self._half[id(st)] = (h0 + chunks) % 2
        if to_gpu and chunks:
            st.wait_event(free[(h0 + chunks - 1) % 2])

    def _side_stream(self, st) -> torch.cuda.Stream:
        side = self._sides.get(id(st))
        if side is None:
            side = self._sides[id(st)] = torch.cuda.Stream(self.device)
        return side

    def _indices(self, st, blocks: np.ndarray) -> torch.Tensor:
        """``blocks`` on the device, valid on ``st``: through ``st``'s staging ring (S3:
        the host buffer is not rewritten before the copy out of it has run), once for
        all the layer groups of a batch (``_copy`` hands each group the same array)."""
        last = self._ids.get(id(st))
        if last is not None and last[0] is blocks:
            return last[1]
        stager = self._stagers.get(id(st))
        if stager is None:
            stager = self._stagers[id(st)] = Stager(self._upload, slots=INDEX_SLOTS)
        ids = stager.stage(np.asarray(blocks, dtype=np.int64), st)
        self._ids[id(st)] = (blocks, ids)  # holds the array: its id is not reused while cached
        return ids

    def index_uploads(self) -> int:
        """How many block-id arrays the staged path has uploaded (one a batch)."""
        return sum(s.counters.stages for s in self._stagers.values())

    def _on(self, st):
        """Kernels queued inside go on ``st`` (no-op off CUDA: the executor's tests on CPU)."""
        return torch.cuda.stream(st) if self.device.type == "cuda" else contextlib.nullcontext()

    def close(self) -> None:
        super().close()
        for stager in self._stagers.values():
            stager.close()
        self._stagers.clear()
        self._ids.clear()
        self._stages.clear()
