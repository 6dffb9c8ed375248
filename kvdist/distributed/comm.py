"""The library's own communicator and its deadline-bounded collectives.

kvdist never uses ``COMM_WORLD`` directly: ``resolve`` Dups the communicator it is
given (or ``COMM_WORLD`` when MPI is running), and a job started without MPI gets a
single-rank stand-in (:class:`SingleComm`) that needs no MPI library at all. Both
offer the same collectives, so the start-up protocol has one code path.

Every collective of :class:`MpiComm` is a non-blocking MPI collective polled against
a deadline of ``timeout_s`` (``distributed.consensus_timeout_s``): when a rank never
arrives, the ranks that did raise :class:`~kvdist.errors.ConsensusTimeout` instead of
hanging. A collective that timed out can never be cancelled, so its request and
buffers are kept alive for the rest of the process (MPI may still write into them)
and the communicator refuses any further collective: a late rank would otherwise
match its contribution with the wrong operation.

Node-local ranks come from ``Split_type(COMM_TYPE_SHARED)``. For tests, the
environment variable ``KVDIST_FAKE_RANKS_PER_NODE=N`` replaces that split by
contiguous groups of N ranks (ranks 0..N-1 are node 0, N..2N-1 node 1, ...), so CI
can fake 2 nodes x 2 ranks on one machine. Everything that depends on the node
layout (device selection, host-tier auto-sizing, the launcher's rank->GPU choice)
goes through :func:`node_info` / ``comm.node`` and therefore honours it."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import CollectiveMismatch, ConfigError, ConsensusTimeout
from . import stall

FAKE_RANKS_PER_NODE_ENV = "KVDIST_FAKE_RANKS_PER_NODE"

_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
                  "MPI_LOCALNRANKS", "HYDI_CONTROL_FD", "SLURM_STEP_NUM_TASKS")

# Requests (and their buffers) of collectives that timed out: MPI may still complete
# them when a late rank arrives, so they must outlive the communicator.
_ORPHANS: list[tuple] = []


def keep_alive(*things: object) -> None:
    """Keep ``things`` (requests, and the buffers and memory they use) for the rest of
    the process: MPI may still complete operations nobody can wait for (a peer that is
    stopped or gone) and must not find their memory freed."""
    _ORPHANS.append(things)


def mpi_is_running() -> bool:
    """True when this process was started by an MPI launcher or has MPI initialized."""
    if "mpi4py.MPI" in sys.modules:
        return True
    return any(v in os.environ for v in _LAUNCHER_VARS)


def fake_ranks_per_node() -> int | None:
    """N from ``KVDIST_FAKE_RANKS_PER_NODE`` (None when unset)."""
    raw = os.environ.get(FAKE_RANKS_PER_NODE_ENV, "")
    if raw == "":
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n <= 0:
        raise ConfigError(FAKE_RANKS_PER_NODE_ENV, raw, "must be a positive int (ranks per fake node)")
    return n


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """Where a rank sits: its rank among the ranks of its node, how many ranks the node
    has, the node's index (nodes numbered by their lowest rank) and the node count."""

    local_rank: int = 0
    local_size: int = 1
    node: int = 0
    num_nodes: int = 1


class SingleComm:
    """World of one rank, without MPI. Its collectives return at once."""

    rank = 0
    size = 1
    mpi = None

    def __init__(self, timeout_s: float = 120.0):
        self.timeout_s = timeout_s
        self.node = NodeInfo()

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def local_size(self) -> int:
        return 1

    def allreduce_max(self, value: int, what: str) -> int:
        return int(value)

    def allreduce_min(self, values: Sequence[int], what: str) -> list[int]:
        return [int(v) for v in values]

    def allgather_ints(self, values: Sequence[int], what: str) -> np.ndarray:
        return np.asarray(values, dtype=np.int64).reshape(1, -1)

    def allreduce_min_array(self, values: np.ndarray, what: str) -> np.ndarray:
        return np.asarray(values, dtype=np.int64).reshape(-1).copy()

    def allgather(self, obj: object, what: str, timeout_s: float | None = None) -> list[object]:
        return [obj]

    def allreduce_sum_(self, array: np.ndarray, what: str) -> np.ndarray:
        return array

    def bcast(self, obj: object, what: str, timeout_s: float | None = None) -> object:
        return obj

    def barrier(self, what: str, timeout_s: float | None = None) -> None:
        pass

    def run_time(self, step_timeout_s: float | None) -> None:
        pass

    @property
    def usable(self) -> bool:
        return True

    def take_notices(self) -> list:
        return []

    def peek_notices(self) -> list:
        return []

    def notify_all(self, obj: object) -> None:
        pass

    def free(self) -> None:
        pass


class MpiComm:
    """A Dup of an mpi4py communicator, its node layout, and collectives bounded by
    ``timeout_s`` — at run time (after :meth:`run_time`) by the step deadline instead,
    each preceded by a tag naming the call (see the module docstring)."""

    def __init__(self, comm, timeout_s: float):
        from mpi4py import MPI

        self.MPI = MPI
        self.timeout_s = timeout_s
        self.broken: str | None = None  # the collective that timed out, if one did
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.mpi = None
        self.pace: stall.Pace | None = None  # run time: the step deadline
        self.watch: stall.Watch | None = None  # run time: where a stall is told
        # Run time: polled while waiting; an exception it returns ends the wait (raised).
        self.interrupt: Callable[[], BaseException | None] | None = None
        dup, req = comm.Idup()
        self._wait(req, time.monotonic() + timeout_s, "joining the communicator (Idup)", (dup,))
        self.mpi = dup
        try:
            self.node = _split_node(self, dup)
        except BaseException:
            self.free()
            raise

    @property
    def local_rank(self) -> int:
        return self.node.local_rank

    @property
    def local_size(self) -> int:
        return self.node.local_size

    @property
    def usable(self) -> bool:
        """Whether collectives can still run: none timed out, and (at run time) the
        process learned of no stall."""
        return self.broken is None and self.mpi is not None and (self.pace is None or stall.ended() is None)

    def run_time(self, step_timeout_s: float | None) -> None:
        """From now on bound every collective by the step deadline (``None``: auto) and
        name the ranks that do not arrive (collective; once, later calls do nothing)."""
        if self.pace is not None:
            return
        deadline = self._usable("run-time watch")
        dup, req = self.mpi.Idup()
        self._wait(req, deadline, "run-time watch", (dup,))
        # The world rank names a rank for the operator (mpiexec's numbering) only.
        me = stall.Peer(self.MPI.COMM_WORLD.Get_rank(), socket.gethostname(), os.getpid())
        try:
            peers = self.allgather(me, "run-time watch")
        except BaseException:
            keep_alive(dup)
            raise
        self.watch = stall.Watch(dup, peers, self.rank)
        self.pace = stall.Pace(step_timeout_s, self.timeout_s)

    # -- deadline-bounded completion ------------------------------------------------------
    def _wait(self, req, deadline: float, what: str, keep: tuple) -> None:
        """Poll ``req`` until it completes or ``deadline`` passes (then ConsensusTimeout,
        or at run time the stall's error naming the ranks that did not arrive).

        Polling is the only way to bound an MPI wait. For the first ~10 ms the rank
        yields its core between polls (peers that arrive together finish in a few round
        trips even when ranks outnumber cores); after that it sleeps up to 2 ms between
        polls, leaving the cores to ranks still pinning their host tiers. At run time it
        also answers the stall reports of peers (every watch of the process)."""
        start = time.monotonic()
        pause = 5e-5
        watched = self.pace is not None
        next_poll = start
        while not req.Test():
            now = time.monotonic()
            if watched and now >= next_poll:
                next_poll = now + 0.005
                try:
                    stall.poll(what, start, self.watch)
                    stop = self.interrupt() if self.interrupt is not None else None
                    if stop is not None:
                        raise stop
                except BaseException:
                    self._orphan(req, keep, what)
                    raise
            if now >= deadline:
                self._orphan(req, keep, what)
                if watched:
                    raise stall.expired(self.watch, what, now - start, self.pace.setting())
                raise ConsensusTimeout(
                    f"rank {self.rank}: collective '{what}' did not complete within "
                    f"{self.timeout_s:g} s (distributed.consensus_timeout_s): at least one of "
                    f"the {self.size} ranks never arrived")
            if now - start < 0.01:
                os.sched_yield()
            else:
                time.sleep(max(0.0, min(pause, deadline - now)))
                pause = min(pause * 2, 2e-3)
        if watched:
            self.pace.completed()

    def _orphan(self, req, keep: tuple, what: str) -> None:
        _ORPHANS.append((req, keep))
        self.broken = what

    def _usable(self, what: str, timeout_s: float | None = None) -> float:
        if self.pace is not None and stall.ended() is not None:
            self.broken = self.broken or what
            raise stall.ended()
        if self.broken is not None:
            raise ConsensusTimeout(
                f"rank {self.rank}: cannot run '{what}': the communicator is unusable since "
                f"collective '{self.broken}' timed out")
        assert self.mpi is not None, "collective on a freed communicator"
        if timeout_s is None:
            timeout_s = self.timeout_s if self.pace is None else self.pace.timeout_s()
        return time.monotonic() + timeout_s

    def _header(self, what: str, count: int, deadline: float) -> np.ndarray:
        """Run time: every rank's ``(tag of what, count)`` (``[size, 2]``), raising
        CollectiveMismatch on every rank when the ranks called different collectives or
        passed different counts. Start-up: nothing to compare (None)."""
        stall.poll(what, time.monotonic(), self.watch)  # a stall a peer found ends this call at once
        mine = np.array([zlib.crc32(what.encode()), count], dtype=np.int64)
        rows = np.empty((self.size, 2), dtype=np.int64)
        self._wait(self.mpi.Iallgather(mine, rows), deadline, what, (mine, rows))
        if (rows[:, 0] != rows[0, 0]).any():
            names = self._gather_plain(what, "call names", deadline)
            self.broken = what
            world = [p.rank for p in self.watch.peers]  # named by world rank
            calls = {world[r]: n for r, n in enumerate(names)}
            odd = "; ".join(f"rank {r} called {n}" for r, n in calls.items() if n != what)
            raise CollectiveMismatch(
                f"rank {world[self.rank]} called {what}, but {odd}: the ranks called different collectives",
                calls)
        return rows

    def _gather_plain(self, obj: object, what: str, deadline: float) -> list:
        """Every rank's ``obj``, without a header (everyone is known to call it)."""
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        size = np.array([data.size], dtype=np.int64)
        sizes = np.empty(self.size, dtype=np.int64)
        self._wait(self.mpi.Iallgather(size, sizes), deadline, what, (size, sizes))
        return self._gatherv(data, sizes, deadline, what)

    def _gatherv(self, data: np.ndarray, sizes: np.ndarray, deadline: float, what: str) -> list:
        offsets = np.zeros(self.size, dtype=np.int64)
        np.cumsum(sizes[:-1], out=offsets[1:])
        recv = np.empty(int(sizes.sum()), dtype=np.uint8)
        req = self.mpi.Iallgatherv(data, [recv, (sizes, offsets), self.MPI.BYTE])
        self._wait(req, deadline, what, (data, recv, sizes, offsets))
        return [pickle.loads(recv[o:o + n].tobytes()) for o, n in zip(offsets.tolist(), sizes.tolist())]

    # -- collectives ------------------------------------------------------------------------
    def _allreduce(self, values: Sequence[int], op, what: str) -> np.ndarray:
        deadline = self._usable(what)
        send = np.asarray(values, dtype=np.int64).reshape(-1)
        if self.pace is not None:
            rows = self._header(what, send.size, deadline)
            if (rows[:, 1] != send.size).any():
                self.broken = what
                raise CollectiveMismatch(
                    f"'{what}': the ranks passed different numbers of values "
                    f"({', '.join(f'rank {r}: {n}' for r, n in enumerate(rows[:, 1].tolist()))})",
                    {r: what for r in range(self.size)})
        recv = np.empty_like(send)
        self._wait(self.mpi.Iallreduce(send, recv, op=op), deadline, what, (send, recv))
        return recv

    def allreduce_max(self, value: int, what: str) -> int:
        """MAX over ranks of one int."""
        return int(self._allreduce([value], self.MPI.MAX, what)[0])

    def allreduce_min(self, values: Sequence[int], what: str) -> list[int]:
        """Element-wise MIN over ranks of a vector of ints."""
        return self._allreduce(values, self.MPI.MIN, what).tolist()

    def allreduce_min_array(self, values: np.ndarray, what: str) -> np.ndarray:
        """Element-wise MIN over ranks of an int array (as int64)."""
        return self._allreduce(values, self.MPI.MIN, what)

    def allreduce_sum_(self, array: np.ndarray, what: str) -> np.ndarray:
        """SUM over ranks of a contiguous numeric array, in place. No tag: the hot path
        of a tensor-parallel model (the same call on every rank by construction), still
        bounded by the deadline."""
        deadline = self._usable(what)
        self._wait(self.mpi.Iallreduce(self.MPI.IN_PLACE, array, op=self.MPI.SUM), deadline, what, (array,))
        return array

    def allgather_ints(self, values: Sequence[int], what: str) -> np.ndarray:
        """``[size, len(values)]`` int64: row r is rank r's ``values``."""
        deadline = self._usable(what)
        send = np.asarray(values, dtype=np.int64).reshape(-1)
        if self.pace is not None:
            self._header(what, send.size, deadline)
        recv = np.empty((self.size, send.size), dtype=np.int64)
        self._wait(self.mpi.Iallgather(send, recv), deadline, what, (send, recv))
        return recv

    def allgather(self, obj: object, what: str, timeout_s: float | None = None) -> list[object]:
        """Every rank's picklable ``obj``, in rank order (two collectives: sizes, bytes).
        ``timeout_s``: this call's bound instead of the communicator's."""
        deadline = self._usable(what, timeout_s)
        if self.pace is None:
            return self._gather_plain(obj, what, deadline)
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        sizes = self._header(what, data.size, deadline)[:, 1].copy()
        return self._gatherv(data, sizes, deadline, what)

    def bcast(self, obj: object, what: str, timeout_s: float | None = None) -> object:
        """Rank 0's picklable ``obj`` on every rank (run time only)."""
        deadline = self._usable(what, timeout_s)
        assert self.pace is not None, "bcast is a run-time collective"
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if self.rank == 0 else np.empty(0, np.uint8)
        n = int(self._header(what, data.size, deadline)[0, 1])
        buf = data.copy() if self.rank == 0 else np.empty(n, dtype=np.uint8)
        self._wait(self.mpi.Ibcast(buf, root=0), deadline, what, (buf,))
        return obj if self.rank == 0 else pickle.loads(buf.tobytes())

    def barrier(self, what: str, timeout_s: float | None = None) -> None:
        deadline = self._usable(what, timeout_s)
        if self.pace is not None:
            self._header(what, 0, deadline)  # completes once every rank called it
        else:
            self._wait(self.mpi.Ibarrier(), deadline, what, ())

    def notify_all(self, obj: object) -> None:
        """Post ``obj`` to every other rank, point to point (run time; see stall.Watch)."""
        assert self.watch is not None, "notices need run_time()"
        self.watch.notify_all(obj)

    def take_notices(self) -> list:
        """What other ranks posted with ``notify_all`` since the last call, oldest first."""
        return [] if self.watch is None else self.watch.take_notices()

    def peek_notices(self) -> list:
        """What ``take_notices`` would return, left there."""
        return [] if self.watch is None else self.watch.peek_notices()

    def free(self) -> None:
        """Release the Dup. After a timeout the Dup stays allocated: MPI may still
        progress the orphaned collective on it."""
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if self.mpi is not None:
            if self.broken is None:
                self.mpi.Free()
            else:
                _ORPHANS.append((self.mpi,))
            self.mpi = None


def _split_node(comm: MpiComm, dup) -> NodeInfo:
    """The node layout from ``Split_type(COMM_TYPE_SHARED)`` (or the fake split)."""
    per = fake_ranks_per_node()
    rank = comm.rank
    if per is None:
        node_comm = dup.Split_type(comm.MPI.COMM_TYPE_SHARED, key=rank)
    else:
        node_comm = dup.Split(rank // per, rank)
    try:
        local_rank, local_size = node_comm.Get_rank(), node_comm.Get_size()
        # Blocking is safe here: every rank of the node has just passed the Split with us.
        lowest = node_comm.allreduce(rank, op=comm.MPI.MIN)
    finally:
        node_comm.Free()
    # Nodes are numbered by their lowest rank (placement may be round-robin).
    lowest_of = comm.allgather_ints([lowest], "node layout")[:, 0].tolist()
    leaders = sorted(set(lowest_of))
    return NodeInfo(local_rank, local_size, leaders.index(lowest), len(leaders))


def resolve(comm=None, timeout_s: float = 120.0) -> SingleComm | MpiComm:
    """The library's communicator for ``comm`` (a Dup), or for COMM_WORLD when None and
    MPI is running, or a single-rank stand-in. Collective over ``comm``; bounded by
    ``timeout_s``."""
    if comm is None:
        if not mpi_is_running():
            return SingleComm(timeout_s)
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    return MpiComm(comm, timeout_s)


def node_info(comm=None, timeout_s: float = 120.0) -> NodeInfo:
    """The node layout of this rank in ``comm`` (COMM_WORLD when None and MPI runs),
    for engines that pick their GPU before creating the cache
    (``kvdist.select_device("auto", node_info().local_rank)``). Collective."""
    c = resolve(comm, timeout_s)
    try:
        return c.node
    finally:
        c.free()
