"""The moves the block pool (``kvdist.block_pool``) made since it last handed them to
the transfer engine, held as the engine and the block log take them: two u64 arrays
(``srcs``, ``dsts``: move i copies the block of ``srcs[i]`` into ``dsts[i]``) and the
runs of one route over them (``runs``: each run's route and first index, in order; a
move on the route of the last run extends it). No Python object per move: the pool's
cascade appends a move's two slot ids itself (``BlockPool.move``: no call per move), a
run of moves (``add_run``) its two arrays' bytes.

``hand_over`` queues each run's copies with the engine (one ``copy_many`` call per
run of 32 or more, else one ``copy`` a move), writes the moves to the block log
whole (``LOG_MOVED n src*n dst*n``: the two arrays as they are), and empties the
queue (slot ids are never negative: the engine reads the arrays' bytes as int64).
``host_changes`` reads the host slots the runs empty and fill off their routes, for
the remote tier's stamps (rule R2), before ``hand_over``."""

from __future__ import annotations

import struct
from array import array

import numpy as np

from .block_observers import LOG_MOVED, U64, BlockObserver
from .blocks import HOST
from .transfer import Route, TransferEngine

__all__ = ["COPY_MANY_FROM", "MoveQueue"]

_TWO_WORDS = struct.Struct(f"2{U64}")  # the head of a run's words in the log
COPY_MANY_FROM = 32  # copies of a run; fewer go to the engine one by one (see hand_over)


class MoveQueue:
    """The pending moves, in order (module docstring). Invariant: ``runs`` is empty iff
    ``srcs`` is; run i covers ``srcs[runs[i][1] : runs[i + 1][1]]`` (the last: to the
    end), and no two neighbouring runs share a route; ``last`` is the last run's route
    (None when empty); ``dsts`` is as long as ``srcs``."""

    __slots__ = ("dsts", "last", "runs", "srcs")

    def __init__(self) -> None:
        self.srcs, self.dsts = array("Q"), array("Q")  # u64: the log's words as they are (joined whole)
        self.runs: list[tuple[Route, int]] = []
        self.last: Route | None = None

    def __len__(self) -> int:
        return len(self.srcs)

    def add_run(self, srcs: np.ndarray, dsts: np.ndarray, along: Route) -> None:
        """Moves ``srcs[i] -> dsts[i]`` (int64 arrays of one length), in order."""
        if along is not self.last:
            self.runs.append((along, len(self.srcs)))
            self.last = along
        self.srcs.frombytes(srcs.tobytes())
        self.dsts.frombytes(dsts.tobytes())

    def _spans(self):
        """Each run as ``(route, start, end)``."""
        runs, n = self.runs, len(self.srcs)
        for i, (along, start) in enumerate(runs):
            yield along, start, runs[i + 1][1] if i + 1 < len(runs) else n

    def host_changes(self) -> tuple[list[int], list[int]]:
        """The host slots the pending moves empty (their sources) and fill (their
        destinations), in order."""
        emptied: list[int] = []
        filled: list[int] = []
        for along, a, b in self._spans():
            if along.src == HOST:
                emptied += self.srcs[a:b].tolist()
            if along.dst == HOST:
                filled += self.dsts[a:b].tolist()
        return emptied, filled

    def hand_over(self, engine: TransferEngine, observer: BlockObserver | None) -> None:
        """Queue every run's copies with ``engine`` in order, append the moves to the
        block observer's log (None: nobody's), and empty the queue."""
        srcs, dsts = self.srcs, self.dsts
        for along, a, b in self._spans():
            if b - a < COPY_MANY_FROM:
                copy = engine.copy
                for s, d in zip(srcs[a:b], dsts[a:b]):
                    copy(along, s, d)
            else:  # the slices are the engine's: never a view of the arrays, which grow
                engine.copy_many(along, np.frombuffer(srcs[a:b], dtype=np.int64),
                                 np.frombuffer(dsts[a:b], dtype=np.int64))
        if observer is not None:
            words = b"".join((_TWO_WORDS.pack(LOG_MOVED, len(srcs)), srcs, dsts))  # one write (a C call)
            try:
                observer.log.write(words)
            except ValueError:
                observer.overflow(words)
        del srcs[:], dsts[:]
        self.runs.clear()
        self.last = None

    def check_invariants(self) -> None:
        assert len(self.srcs) == len(self.dsts), f"{len(self.srcs)} sources for {len(self.dsts)} destinations"
        assert bool(self.runs) == bool(self.srcs), f"{len(self.runs)} runs over {len(self.srcs)} moves"
        assert all(a < b for _, a, b in self._spans()), f"an empty run in {self.runs}"
        assert all(x[0] is not y[0] for x, y in zip(self.runs, self.runs[1:])), \
            "two neighbouring runs of one route"
        assert self.last is (self.runs[-1][0] if self.runs else None), "last is not the last run's route"
