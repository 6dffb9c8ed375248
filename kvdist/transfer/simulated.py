"""Simulated asynchronous streams on CPU (``KVDIST_SIMULATE_ASYNC=1``).

Each submitted batch becomes an operation queued on a simulated stream; nothing runs
until something that must follow it waits on it (the compute stream at S5, a host
synchronize, or a later operation that depends on it). Operations are FIFO within a
stream, as on a GPU, but copies inside one batch run in reverse order and, when many
operations are forced at once, the most recently submitted one is forced first. Every
ordering the engine forgot to declare is therefore violated, and shows up as wrong
bytes. Tests may ``hold`` a stream and ``release`` it step by step.

With layer groups (``cache.layer_groups`` > 1) a batch between the GPU and the host
tier is one operation per group, layer 0's first, each following group g of the
grouped batches it depends on (S2 per group), and its event is a ``SimGroups``:
``compute_wait(events, layer)`` forces only the operations up to that layer's group,
so a layer read before its group was waited for still holds the old bytes."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ..layout import LayerGroups
from .contract import TIMED, Event, ExecutorCounters, Timing
from .executors import BatchLog, Copies
from .routes import OFFLOAD, ONBOARD, STREAMS, Route

__all__ = ["SimDeadlock", "SimExecutor", "SimGroups", "SimOp"]


class SimDeadlock(RuntimeError):
    """Forcing an operation needs one queued on a held stream."""


class SimOp:
    __slots__ = ("deps", "done", "fn", "seq", "stream")

    def __init__(self, seq: int, stream: SimStream, fn: Callable[[], None], deps: list[SimOp]):
        self.seq, self.stream, self.fn, self.deps, self.done = seq, stream, fn, deps, False

    def __repr__(self) -> str:
        return f"SimOp#{self.seq}@{self.stream.name}{'(done)' if self.done else ''}"


class SimGroups:
    """The event of a batch copied one layer group at a time: ``ops[g]`` copies group g."""

    __slots__ = ("ops",)

    def __init__(self, ops: list[SimOp]):
        self.ops = ops

    @property
    def last(self) -> SimOp:
        return self.ops[-1]


def _op(event, groups: LayerGroups | None = None, layer: int | None = None) -> SimOp | None:
    """The operation to wait for: a whole batch's last, or the group holding ``layer``."""
    if isinstance(event, SimGroups):
        return event.ops[groups.group_of[layer]] if layer is not None else event.last
    return event


class SimStream:
    __slots__ = ("held", "last", "name")

    def __init__(self, name: str):
        self.name = name
        self.held = False
        self.last: SimOp | None = None


class SimExecutor:
    """Lazy, adversarial executor over simulated streams; see the module docstring."""

    path = "simulated"
    background_disk = True  # the disk stream's batches run when forced

    def __init__(self, copies: Copies | None, log: BatchLog | None = None,
                 groups: LayerGroups | None = None):
        self.copies = copies
        self.groups = groups if groups is not None and len(groups) > 1 else None
        self.layered = self.groups is not None
        self._layer_events: list = []  # of the last compute_wait(layered=True)
        self._kernel_events: list | None = None  # the running kernel's view of those
        self._timings: list[Timing] = []
        self.compute_wait_seconds = 0.0  # S5: host time spent running the copies compute waits for
        # "remote": the remote tier's fetches (kvdist.distributed.shared_transport).
        self.streams = {name: SimStream(name) for name in (*STREAMS, "compute", "remote")}
        self._queued: list[SimOp] = []
        self._seq = 0
        self.log = log
        self.counters = ExecutorCounters()
        self.simulated_compute = self  # kernel() and force()
        # Host->device uploads (block tables) run when queued, as a CPU engine that reads
        # them at once needs, unless their stream is held or the device "runs behind"
        # (a driver one step ahead of its simulated kernels): then they wait to be forced.
        self.runs_behind = False

    # -- queueing -------------------------------------------------------------------------
    def enqueue(self, stream: str, fn: Callable[[], None], deps: list | None = None) -> SimOp:
        st = self.streams[stream]
        all_deps = [d for d in map(_op, deps or []) if d is not None and not d.done]
        if st.last is not None and not st.last.done:
            all_deps.append(st.last)
        self._seq += 1
        op = SimOp(self._seq, st, fn, all_deps)
        st.last = op
        self._queued.append(op)
        return op

    def submit(self, route: Route, src: np.ndarray, dst: np.ndarray, deps: list[Event]) -> SimOp:
        src, dst = np.asarray(src).tolist(), np.asarray(dst).tolist()
        if self.log is not None:
            self.log.append((route.name, list(src), list(dst)))
        src, dst = src[::-1], dst[::-1]  # no order inside a batch: run it backwards
        if self.groups is not None and route in (OFFLOAD, ONBOARD):
            # Group g waits for group g of the grouped batches it follows (as on CUDA).
            copy, deps = self.copies.run_span, deps or []
            return SimGroups([self.enqueue(route.stream, self._timed(
                route, len(src) * (hi - lo), lambda span=(lo, hi): copy(route, src, dst, span)),
                [e.ops[g] if isinstance(e, SimGroups) else e for e in deps])
                for g, (lo, hi) in enumerate(self.groups.spans)])
        nbytes = len(src) * (self.copies.block_bytes if self.copies is not None else 0)
        return self.enqueue(route.stream, self._timed(
            route, nbytes, lambda: self.copies.run(route, src, dst, vectorized=False)), deps)

    def _timed(self, route: Route, nbytes: int, fn: Callable[[], None]) -> Callable[[], None]:
        if route not in TIMED:
            return fn

        def run() -> None:
            t0 = time.perf_counter()
            fn()
            self._timings.append((route, nbytes, time.perf_counter() - t0))
        return run

    def take_timings(self) -> list[Timing]:
        out, self._timings = self._timings, []
        return out

    def kernel(self, fn: Callable[[], None]) -> SimOp:
        """Queue a 'kernel' on the simulated compute stream (a forward pass, tests).
        Its per-layer waits (``wait_layer``, from ``kv_pool`` inside ``fn``) are for the
        copies compute was told to wait for when the kernel was queued — on a GPU the
        host enqueues them then — not for those of a later step by the time it runs."""
        events = self._layer_events

        def run() -> None:
            outer, self._kernel_events = self._kernel_events, events
            try:
                fn()
            finally:
                self._kernel_events = outer
        return self.enqueue("compute", run)

    def record_compute(self) -> SimOp | None:
        last = self.streams["compute"].last
        return None if last is None or last.done else last

    # -- waiting ---------------------------------------------------------------------------
    def force(self, op: SimOp | SimGroups) -> None:
        """Run ``op`` and, first, everything it depends on."""
        stack = [_op(op)]
        while stack:
            top = stack[-1]
            if top.done:
                stack.pop()
                continue
            pending = [d for d in top.deps if not d.done]
            if pending:
                stack.extend(sorted(pending, key=lambda d: d.seq))  # latest forced first
                continue
            if top.stream.held:
                raise SimDeadlock(f"{top} is needed but stream {top.stream.name!r} is held")
            top.fn()
            top.done = True
            stack.pop()
        self._queued = [o for o in self._queued if not o.done]

    def compute_wait(self, events: list, layered: bool = False) -> None:
        """S5 on CPU: compute is the host itself, so it runs what it waits for, now
        (``layered``: layer by layer, in ``wait_layer``)."""
        if layered:
            self._layer_events = [e for e in events if e is not None]
        else:
            self._force_all(events, None)

    def wait_layer(self, layer: int) -> None:
        """Run the copies of ``layer``'s group (and what they follow) of the batches
        compute waits for: the running kernel's, or the host's latest."""
        events = self._kernel_events if self._kernel_events is not None else self._layer_events
        self._force_all(events, layer)

    def _force_all(self, events: list, layer: int | None) -> None:
        t0 = time.perf_counter()
        ops = [op for op in (_op(e, self.groups, layer) for e in events) if op is not None]
        for op in sorted(ops, key=lambda o: -o.seq):
            self.force(op)
        self.compute_wait_seconds += time.perf_counter() - t0

    def synchronize(self) -> None:
        while self._queued:
            self.force(max(self._queued, key=lambda o: o.seq))

    def wait_host(self, events: list) -> None:
        """The host waits for ``events``: run them (and what they follow) now."""
        for ev in events:
            if ev is not None:
                self.force(ev)

    def drain(self, stream: str) -> None:
        last = self.streams[stream].last
        if last is not None:
            self.force(last)

    def hold(self, stream: str) -> None:
        self.streams[stream].held = True

    def release(self, stream: str) -> None:
        self.streams[stream].held = False

    @staticmethod
    def is_done(event: SimOp | SimGroups | None) -> bool:
        event = _op(event)
        return event is None or event.done

    def holds_host(self, event: SimOp | SimGroups | None) -> bool:
        """Disk work that cannot run now (what the CUDA executor's host would wait for):
        as ``poll``, asking runs it unless a stream it needs is held."""
        op = _op(event)
        if op is None or op.done or op.stream.name not in ("disk", "promote"):
            return False
        return not self.poll([op])

    def poll(self, events: list) -> bool:
        """Run ``events`` (and what they follow) now, unless a stream they need is held:
        then False, what could run having run."""
        try:
            self.wait_host(events)
        except SimDeadlock:
            return False
        return True

    def queued(self) -> int:
        return sum(not o.done for o in self._queued)

    def stats(self) -> dict[str, object]:
        return {"path": self.path, "queued": self.queued()}

    def close(self) -> None:
        pass
