"""Simulated asynchronous streams on CPU (``KVDIST_SIMULATE_ASYNC=1``).

Each submitted batch becomes an operation queued on a simulated stream; nothing runs
until something that must follow it waits on it (the compute stream at S5, a host
synchronize, or a later operation that depends on it). Operations are FIFO within a
stream, as on a GPU, but copies inside one batch run in reverse order and, when many
operations are forced at once, the most recently submitted one is forced first. Every
ordering the engine forgot to declare is therefore violated, and shows up as wrong
bytes. Tests may ``hold`` a stream and ``release`` it step by step."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .contract import Event, ExecutorCounters
from .executors import BatchLog, HostCopies
from .routes import STREAMS, Route

__all__ = ["SimDeadlock", "SimExecutor", "SimOp"]


class SimDeadlock(RuntimeError):
    """Forcing an operation needs one queued on a held stream."""


class SimOp:
    __slots__ = ("deps", "done", "fn", "seq", "stream")

    def __init__(self, seq: int, stream: SimStream, fn: Callable[[], None], deps: list[SimOp]):
        self.seq, self.stream, self.fn, self.deps, self.done = seq, stream, fn, deps, False

    def __repr__(self) -> str:
        return f"SimOp#{self.seq}@{self.stream.name}{'(done)' if self.done else ''}"


class SimStream:
    __slots__ = ("held", "last", "name")

    def __init__(self, name: str):
        self.name = name
        self.held = False
        self.last: SimOp | None = None


class SimExecutor:
    """Lazy, adversarial executor over simulated streams; see the module docstring."""

    path = "simulated"

    def __init__(self, copies: HostCopies | None, log: BatchLog | None = None):
        self.copies = copies
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
        all_deps = [d for d in (deps or []) if d is not None and not d.done]
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
        return self.enqueue(route.stream, lambda: self.copies.run(route, src, dst, vectorized=False), deps)

    def kernel(self, fn: Callable[[], None]) -> SimOp:
        """Queue a 'kernel' on the simulated compute stream (a forward pass, tests)."""
        return self.enqueue("compute", fn)

    def record_compute(self) -> SimOp | None:
        last = self.streams["compute"].last
        return None if last is None or last.done else last

    # -- waiting ---------------------------------------------------------------------------
    def force(self, op: SimOp) -> None:
        """Run ``op`` and, first, everything it depends on."""
        stack = [op]
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

    def compute_wait(self, events: list) -> None:
        """S5 on CPU: compute is the host itself, so it runs what it waits for, now."""
        for ev in sorted((e for e in events if e is not None), key=lambda e: -e.seq):
            self.force(ev)

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
    def is_done(event: SimOp | None) -> bool:
        return event is None or event.done

    def queued(self) -> int:
        return sum(not o.done for o in self._queued)

    def stats(self) -> dict[str, object]:
        return {"path": self.path, "queued": self.queued()}

    def close(self) -> None:
        pass
