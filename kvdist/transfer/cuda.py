"""The executor for a GPU tier in CUDA memory: an offload stream and an onboard stream
per GPU, one CUDA event per batch as the pending marker of every slot the batch
touches (the engine keys them by physical slot), batched copies (``batchcopy``).

Disk transfers run on worker threads, off the step's critical path, and obey the
same per-slot ordering: a disk task waits inside its worker for the CUDA events it
depends on; a CUDA stream never waits for unfinished disk work. Where a CUDA copy
does depend on disk work (an offload into a host slot a demotion is still reading,
the GPU half of a reload), the host waits for it at the latest moment (the next
submission that needs it, or the compute barrier S5) and the wait is counted.

* demote (host -> disk): the worker waits for the pending writes of its host slots,
  then writes them to disk straight from pinned memory.
* spill (gpu -> disk): the GPU half copies the blocks into a pinned bounce buffer on
  the offload stream; the worker waits for that event and writes the buffer.
* reload (disk -> gpu): the worker reads into a pinned bounce buffer; once it is done
  the host queues the GPU half (bounce -> GPU slots) on the onboard stream.
Bounce buffers are kept (``bounce``) and go back once their own batch is done. A
worker does its batch's disk I/O itself, on numpy views of the rows (no torch op per
block on the host thread, no further thread hop).

Layer by layer (``cache.layer_groups`` > 1): onboards and the GPU half of a reload are
issued one layer group after the other (layer 0's first), an event after each
(``Grouped``); ``wait_layer(layer)`` makes the compute stream wait only for the group
holding that layer, so layer 0's attention starts once layer 0's bytes have landed
while the rest are still on the wire. Offloads go by group too, and a grouped copy
waits for group g of the grouped batches it follows before its own group g: an
onboard into slots an offload is still reading follows it group by group instead of
waiting for all of it. ``cache.layer_groups: auto`` keeps every piece at least
``cache.min_copy_piece`` bytes, which the copy engines move at full rate. Every wait of
the compute stream is timed between two events on it (``compute_wait_seconds``)."""

from __future__ import annotations

import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from ..layout import LayerGroups
from ..storage import DiskPool, GpuPool, HostPool
from .batchcopy import BatchCopier
from .bounce import BouncePool, bounce_blocks
from .contract import Event, ExecutorCounters, Timing
from .cuda_events import DiskOp, Grouped, whole
from .executors import BatchLog
from .routes import DEMOTE, OFFLOAD, ONBOARD, PROMOTE, RELOAD, SPILL, Route

__all__ = ["CudaExecutor", "DiskOp", "Grouped"]


class CudaExecutor:
    """Batched asynchronous copies on side streams; ordering is the engine's."""

    simulated_compute = None
    background_disk = True  # disk batches run on worker threads

    def __init__(self, gpu: GpuPool, host: HostPool | None, disk: DiskPool | None,
                 device: torch.device, *, path: str | None = None, disk_threads: int = 2,
                 log: BatchLog | None = None, groups: LayerGroups | None = None):
        self.gpu, self.host, self.disk, self.device = gpu, host, disk, device
        self.block_bytes = gpu.layout.bytes_per_block
        self.gpu_rows = self._gpu_rows()  # the GPU side of every copy (see _rows_copy)
        self.groups = groups if groups is not None and len(groups) > 1 else None
        self.layered = self.groups is not None
        self.copier = BatchCopier(device, prefer=path)
        self.streams = {name: torch.cuda.Stream(device) for name in (OFFLOAD.stream, ONBOARD.stream)}
        index = device.index if device.index is not None else torch.cuda.current_device()
        # Disk batches: writes (demote, spill) and reads (reload, promote) on workers of their
        # own, so a reload the next forward pass needs does not queue behind demote-ahead's
        # writes. A worker does its batch's I/O itself (DiskPool.run_inline_here): handing it
        # on to the pool's threads cost the step's host thread GIL hand-offs for every batch.
        def start(index: int) -> None:
            torch.cuda.set_device(index)
            disk.run_inline_here()

        def workers(kind: str, threads: int) -> ThreadPoolExecutor | None:
            return (ThreadPoolExecutor(threads, thread_name_prefix=f"kvdist-xfer-{kind}",
                                       initializer=start, initargs=(index,))
                    if disk is not None else None)
        self._workers = workers("write", disk_threads)
        self._readers = workers("read", max(disk_threads, disk.io_threads) if disk is not None else 0)
        # Host blocks per CUDA registration: a merged copy must not cross one (see coalesce).
        self._host_chunk = host.chunk_blocks if host is not None else 0
        # The host tier's rows as numpy views for the disk workers: indexing them takes no
        # torch op on the host thread (each one hands the GIL to whichever worker wants it).
        self._host_rows = host.raw.numpy() if host is not None else None
        self._inflight: list[DiskOp] = []  # disk batches not known complete (some hold a bounce)
        self._bounces = BouncePool(self.block_bytes)
        if disk is not None:  # the engine cuts reloads and spills to bounce_blocks: two such buffers
            self._bounces.reserve(min(bounce_blocks(self.block_bytes), disk.num_blocks), 2)
        self._unsettled: deque[DiskOp] = deque()  # spill/reload GPU halves compute has not waited for
        self.counters = ExecutorCounters()
        self.submit_seconds: Counter[str] = Counter()  # host time in ``submit``, by route
        self.log = log
        self._handlers = {OFFLOAD: self._offload, ONBOARD: self._onboard, DEMOTE: self._demote,
                          SPILL: self._spill, RELOAD: self._reload, PROMOTE: self._promote}
        # Onboards between two timing events on their stream; reload reads timed by their
        # worker (deque: workers append); the compute stream's waits between events on it.
        self._timed: deque[tuple[int, torch.cuda.Event, torch.cuda.Event]] = deque()
        self._timings: deque[Timing] = deque()
        self._waits: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._compute_wait_s = 0.0
        self._layer_events: list = []  # of the last compute_wait(layered=True)
        self._groups_waited: set = set()  # the groups wait_layer has waited for since

    @property
    def path(self) -> str:
        return self.copier.path

    def stats(self) -> dict[str, object]:
        c = self.copier
        return {"path": c.path, "batches_by_path": dict(c.batches), "copy_calls_by_path": dict(c.api_calls),
                "blocks": c.blocks, "host_waits_on_disk": self.counters.host_waits,
                "host_wait_seconds": self.counters.host_wait_seconds,
                "host_wait_read_seconds": self.counters.host_wait_read_seconds,
                "disk_batches": self.counters.disk_batches, "copy_entries": c.entries,
                "bounce_allocations": self._bounces.allocations, "bounces_lent": self._bounces.lent,
                "submit_seconds": {**self.submit_seconds, "bounce_alloc": self._bounces.allocation_seconds},
                **c.describe()}

    # -- waiting -------------------------------------------------------------------------------
    def _host_wait(self, fut: Future, reading: bool = False) -> None:
        if not fut.done():
            t0 = time.perf_counter()
            fut.result()
            waited = time.perf_counter() - t0
            self.counters.host_waits += 1
            self.counters.host_wait_seconds += waited
            if reading:
                self.counters.host_wait_read_seconds += waited
        else:
            fut.result()  # re-raise a worker's error here

    def _finish_reload(self, op: DiskOp) -> None:
        """Queue the GPU half of a reload (the host waits for its read if needed)."""
        self._host_wait(op.future, reading=True)
        t0 = time.perf_counter()
        st = self.streams[ONBOARD.stream]
        n = len(op.gpu_slots)
        op.gpu_event = self._copy(st, op.buffer[:n], self.gpu_rows, np.arange(n), op.gpu_slots, op.gpu_deps,
                                  host_tier=False)
        op.gpu_deps = []
        self.submit_seconds["reload_gpu_half"] += time.perf_counter() - t0

    def _gpu_wait(self, stream: torch.cuda.Stream, deps: list, host_tier: bool,
                  by_group: list | None = None) -> None:
        """``stream`` waits for the GPU side of ``deps``. A demotion has none: it reads
        host slots with the CPU, so a copy that touches the host tier (``host_tier``)
        waits for it on the host. A copy that only reads the slot a demotion reads
        must wait too: the engine keeps one read entry per slot, so a later write to
        the slot waits for this copy alone and relies on it having waited for all its
        dependencies. ``by_group``: a copy by layer group collects its ``Grouped``
        dependencies there instead, to wait for each one's group g before its own
        group g (group g of a slot's bytes depends on group g alone, rule S2)."""
        for e in deps:
            if isinstance(e, DiskOp):
                if e.gpu_pending:
                    self._finish_reload(e)
                if e.gpu_event is None:
                    if host_tier:  # a demotion reads the host slot, a promotion writes it
                        self._host_wait(e.future, reading=e.route is PROMOTE)
                    continue
                e = e.gpu_event
            if by_group is not None and isinstance(e, Grouped):
                by_group.append(e)
            elif isinstance(e, torch.cuda.Event | Grouped):
                stream.wait_event(whole(e))

    @staticmethod
    def _worker_wait(deps: list) -> None:
        """Inside a disk worker: the CUDA events and disk batches a task follows."""
        for e in deps:
            if isinstance(e, torch.cuda.Event | Grouped):
                e.synchronize()
            elif isinstance(e, DiskOp):
                e.future.result()

    def _pump(self) -> None:
        """Queue the GPU halves of finished reloads; forget completed disk batches."""
        for op in list(self._unsettled):
            if op.gpu_pending and op.future.done():
                self._finish_reload(op)
        if self._inflight:  # in any order: a bounce goes back when its own batch is done
            pending = []
            for op in self._inflight:
                if not self.is_done(op):
                    pending.append(op)
                elif op.buffer is not None:
                    self._give_back(op)
            self._inflight = pending
        if self.layered and self._unsettled:  # settled once their GPU half has run
            self._unsettled = deque(op for op in self._unsettled
                                    if op.gpu_event is None or not op.gpu_event.query())
        self._drain_waits()

    # -- the executor interface ---------------------------------------------------------------------
    def submit(self, route: Route, src: np.ndarray, dst: np.ndarray, deps: list[Event]) -> Event:
        """Queue one batch (local slot indices, lists or int64 arrays) after ``deps``."""
        s = np.asarray(src, dtype=np.int64)
        d = np.asarray(dst, dtype=np.int64)
        if self.log is not None:
            self.log.append((route.name, s.tolist(), d.tolist()))
        t0 = time.perf_counter()
        self._pump()
        t1 = time.perf_counter()
        event = self._handlers[route](s, d, deps)
        self.submit_seconds["pump"] += t1 - t0
        self.submit_seconds[route.name] += time.perf_counter() - t1
        return event

    # -- one handler per route ------------------------------------------------------------------------
    def _offload(self, s: np.ndarray, d: np.ndarray, deps: list) -> torch.cuda.Event | Grouped:
        # By layer group too when onboards go so: an onboard into a slot this batch still
        # reads then waits for the group it overwrites, not for the whole batch (S2 per
        # group), so both directions run at once behind the forward pass.
        return self._copy(self.streams[OFFLOAD.stream], self.gpu_rows, self.host.raw, s, d, deps,
                          host_tier=True, dst_chunk=self._host_chunk)

    def _onboard(self, s: np.ndarray, d: np.ndarray, deps: list) -> torch.cuda.Event | Grouped:
        return self._copy(self.streams[ONBOARD.stream], self.host.raw, self.gpu_rows, s, d, deps,
                          host_tier=True, timed=True, src_chunk=self._host_chunk)

    def _copy(self, st: torch.cuda.Stream, src_rows: torch.Tensor, dst_rows: torch.Tensor, s: np.ndarray,
              d: np.ndarray, deps: list, *, host_tier: bool, timed: bool = False,
              **chunks: int) -> torch.cuda.Event | Grouped:
        """One batch on ``st`` after ``deps``: whole blocks, or one layer group after the
        other (each row of a group is a strided slice of its block; runs are not merged
        then), group g waiting for group g of the grouped batches it follows. ``timed``:
        between two timing events (the onboard rate the recompute policy reads), from the
        moment its first group may start."""
        grouped: list[Grouped] | None = [] if self.groups is not None else None
        self._gpu_wait(st, deps, host_tier, grouped)
        start = end = None
        if self.groups is None:
            start = self._record(st, timed)
            self._rows_copy(st, src_rows, dst_rows, s, d, **chunks)
            ev = end = self._record(st, timed)
        else:
            events = []
            for g, (lo, hi) in enumerate(self.groups.spans):
                for e in grouped:
                    st.wait_event(e.events[g])
                if g == 0:
                    start = self._record(st, timed)
                self._rows_copy(st, src_rows, dst_rows, s, d, span=(lo, hi))
                events.append(self._record(st, timed and g == len(self.groups) - 1))
            ev, end = Grouped(events), events[-1]
        if timed:
            self._timed.append((len(s) * self.block_bytes, start, end))
        return ev

    def _gpu_rows(self):
        """The GPU tier as copies see it: the pool's ``[block, bytes]`` rows."""
        return self.gpu.raw

    def _rows_copy(self, st: torch.cuda.Stream, src_rows, dst_rows, s: np.ndarray, d: np.ndarray,
                   span: tuple[int, int] | None = None, **chunks: int) -> None:
        """``dst_rows[d[i]] <- src_rows[s[i]]`` on ``st``: whole blocks, or bytes ``span``
        of each (a layer group's). One side may be ``gpu_rows``."""
        if span is None:
            self.copier.copy(st, src_rows, dst_rows, s, d, **chunks)
        else:
            lo, hi = span
            self.copier.copy(st, src_rows[:, lo:hi], dst_rows[:, lo:hi], s, d)

    def _demote(self, s: np.ndarray, d: np.ndarray, deps: list) -> DiskOp:
        # The CPU reads the host rows: no registration limit.
        rows = [self._host_rows[i] for i in s.tolist()]
        return self._disk_op(DiskOp(DEMOTE, self._workers.submit(self._write_task, deps, d.tolist(), rows)))

    def _spill(self, s: np.ndarray, d: np.ndarray, deps: list) -> DiskOp:
        buffer, rows = self._take_bounce(len(s))
        st = self.streams[OFFLOAD.stream]
        self._gpu_wait(st, deps, host_tier=False)
        self._rows_copy(st, self.gpu_rows, buffer[:len(s)], s, np.arange(len(s)))
        ev = self._record(st)
        disk_deps = [e for e in deps if isinstance(e, DiskOp)] + [ev]
        fut = self._workers.submit(self._write_task, disk_deps, d.tolist(), rows)
        return self._disk_op(DiskOp(SPILL, fut, buffer, gpu_event=ev))

    def _reload(self, s: np.ndarray, d: np.ndarray, deps: list) -> DiskOp:
        buffer, rows = self._take_bounce(len(s))
        disk_deps = [e for e in deps if isinstance(e, DiskOp)]
        fut = self._readers.submit(self._read_task, RELOAD, disk_deps, s.tolist(), rows)
        return self._disk_op(DiskOp(RELOAD, fut, buffer, gpu_slots=d, gpu_deps=list(deps)))

    def _promote(self, s: np.ndarray, d: np.ndarray, deps: list) -> DiskOp:
        # Straight into the host rows (the CPU writes them: no registration limit). The
        # worker waits for every dependency: an offload still writing a slot's previous
        # block is a CUDA event, a demotion still reading it a disk batch.
        rows = [self._host_rows[i] for i in d.tolist()]
        fut = self._readers.submit(self._read_task, PROMOTE, deps, s.tolist(), rows)
        return self._disk_op(DiskOp(PROMOTE, fut))

    def _take_bounce(self, n: int) -> tuple[torch.Tensor, list[np.ndarray]]:
        """A bounce buffer of at least ``n`` blocks, and its first ``n`` rows as numpy
        views for the disk worker."""
        buffer = self._bounces.take(n)
        return buffer, list(buffer.numpy()[:n])

    def _give_back(self, op: DiskOp) -> None:
        """``op`` is complete (its worker done, its GPU half run): its bounce is free."""
        self._bounces.give(op.buffer)
        op.buffer = None

    @staticmethod
    def _record(stream: torch.cuda.Stream, timing: bool = False) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record(stream)
        return ev

    def _disk_op(self, op: DiskOp) -> DiskOp:
        self.counters.disk_batches += 1
        self._inflight.append(op)
        if op.route is RELOAD or op.route is SPILL:  # those with a GPU half
            self._unsettled.append(op)
        return op

    def _write_task(self, deps: list, slots: list[int], rows: list[torch.Tensor]) -> None:
        self._worker_wait(deps)
        self.disk.write_blocks(slots, rows)

    def _read_task(self, route: Route, deps: list, slots: list[int], rows: list[torch.Tensor]) -> None:
        self._worker_wait(deps)
        t0 = time.perf_counter()
        self.disk.read_blocks(slots, rows)
        self._timings.append((route, len(slots) * self.block_bytes, time.perf_counter() - t0))

    def take_timings(self) -> list[Timing]:
        timed = self._timed
        while timed and timed[0][2].query():
            nbytes, start, end = timed.popleft()
            self._timings.append((ONBOARD, nbytes, start.elapsed_time(end) / 1e3))
        out = []
        while self._timings:
            out.append(self._timings.popleft())
        return out

    @property
    def compute_wait_seconds(self) -> float:
        """Time the compute stream stood still at the waits of ``compute_wait`` so far
        (those already completed)."""
        self._drain_waits()
        return self._compute_wait_s

    def _drain_waits(self) -> None:
        waits = self._waits
        while waits and waits[0][1].query():
            before, after = waits.popleft()
            self._compute_wait_s += before.elapsed_time(after) / 1e3

    def record_compute(self) -> torch.cuda.Event:
        self._pump()
        return self._record(torch.cuda.current_stream(self.device))

    def compute_wait(self, events: list[Event], layered: bool = False) -> None:
        """S5: the compute stream waits for ``events`` and for the GPU half of every
        disk batch not waited for yet (disk batches finish in any order, so the last
        one of the 'disk stream' does not stand for the earlier ones) — now, or
        (``layered``) layer by layer in ``wait_layer``."""
        if layered:  # disk batches stay unsettled until their GPU half is done (``_pump``)
            self._layer_events = [e for e in events if isinstance(e, torch.cuda.Event | Grouped)]
            self._layer_events += list(self._unsettled)
            self._groups_waited = set()
            return
        self._wait(lambda e: whole(e), [*self._unsettled, *events])
        self._unsettled.clear()

    def wait_layer(self, layer: int) -> None:
        """The compute stream waits for ``layer``'s group of the batches of the last
        ``compute_wait(events, layered=True)`` (a reload's GPU half is queued first,
        the host waiting for its disk read if it has not finished)."""
        g = self.groups.group_of[layer] if self.groups is not None else None
        if not self._layer_events or g in self._groups_waited:
            return  # nothing to wait for, or waited for at an earlier layer of the group
        self._groups_waited.add(g)
        self._wait(lambda e: e.events[g] if g is not None and isinstance(e, Grouped) else whole(e),
                   self._layer_events)

    def _wait(self, part, events: list) -> None:
        """The compute stream waits for ``part(event)`` of each CUDA event and for the
        GPU half of each disk batch, between two timing events."""
        compute = torch.cuda.current_stream(self.device)
        before = torch.cuda.Event(enable_timing=True)
        before.record(compute)
        for e in events:
            if isinstance(e, DiskOp):  # a demotion touches no GPU memory: nothing to wait for
                if e.gpu_pending:
                    self._finish_reload(e)
                if e.gpu_event is not None:
                    compute.wait_event(part(e.gpu_event))
            elif isinstance(e, torch.cuda.Event | Grouped):
                compute.wait_event(part(e))
        after = torch.cuda.Event(enable_timing=True)
        after.record(compute)
        self._waits.append((before, after))
        self._pump()

    def synchronize(self) -> None:
        for op in list(self._unsettled):
            if op.gpu_pending:
                self._finish_reload(op)
        self._unsettled.clear()
        for op in self._inflight:
            self._host_wait(op.future)
        for st in self.streams.values():
            st.synchronize()
        for op in self._inflight:
            if op.buffer is not None:
                self._give_back(op)
        self._inflight.clear()

    def wait_host(self, events: list[Event]) -> None:
        """The host waits for ``events`` (CUDA events or disk batches), e.g. before
        memory outside the streams' reach (MPI) writes the slots they touch."""
        for e in events:
            if isinstance(e, DiskOp):
                self._host_wait(e.future)
                if e.gpu_pending:
                    self._finish_reload(e)
                if e.gpu_event is not None:
                    e.gpu_event.synchronize()
            elif e is not None:
                e.synchronize()

    def stream_wait(self, stream: torch.cuda.Stream, events: list[Event]) -> None:
        """``stream`` waits for ``events`` (the host only for disk work whose GPU side
        is none), e.g. before a remote fetch on that stream writes the slots they touch."""
        self._gpu_wait(stream, events, host_tier=True)

    @staticmethod
    def holds_host(event: Event | None) -> bool:
        return isinstance(event, DiskOp) and event.gpu_event is None and not event.future.done()

    def is_done(self, event: Event | None) -> bool:
        if event is None:
            return True
        if isinstance(event, DiskOp):
            if not event.future.done():
                return False
            if event.gpu_pending:
                self._finish_reload(event)
            return event.gpu_event is None or event.gpu_event.query()
        return event.query()  # a CUDA event or a Grouped one

    def poll(self, events: list[Event]) -> bool:
        """Whether every one of ``events`` is done (an event query, a future's state:
        never a wait)."""
        return all(self.is_done(e) for e in events)

    def close(self) -> None:
        """Stop the disk workers (after ``synchronize``)."""
        for pool in (self._workers, self._readers):
            if pool is not None:
                pool.shutdown(wait=True)
        self._workers = self._readers = None
