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
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, ConsensusTimeout

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

    def allgather(self, obj: object, what: str) -> list[object]:
        return [obj]

    def barrier(self, what: str) -> None:
        pass

    def free(self) -> None:
        pass


class MpiComm:
    """A Dup of an mpi4py communicator, its node layout, and collectives bounded by
    ``timeout_s``."""

    def __init__(self, comm, timeout_s: float):
        from mpi4py import MPI

        self.MPI = MPI
        self.timeout_s = timeout_s
        self.broken: str | None = None  # the collective that timed out, if one did
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.mpi = None
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

    # -- deadline-bounded completion ------------------------------------------------------
    def _wait(self, req, deadline: float, what: str, keep: tuple) -> None:
        """Poll ``req`` until it completes or ``deadline`` passes (then ConsensusTimeout).

        Polling is the only way to bound an MPI wait. For the first ~10 ms the rank
        yields its core between polls (peers that arrive together finish in a few round
        trips even when ranks outnumber cores); after that it sleeps up to 2 ms between
        polls, leaving the cores to ranks still pinning their host tiers."""
        start = time.monotonic()
        pause = 5e-5
        while not req.Test():
            now = time.monotonic()
            if now >= deadline:
                _ORPHANS.append((req, keep))
                self.broken = what
                raise ConsensusTimeout(
                    f"rank {self.rank}: collective '{what}' did not complete within "
                    f"{self.timeout_s:g} s (distributed.consensus_timeout_s): at least one of "
                    f"the {self.size} ranks never arrived")
            if now - start < 0.01:
                os.sched_yield()
            else:
                time.sleep(min(pause, deadline - now))
                pause = min(pause * 2, 2e-3)

    def _usable(self, what: str) -> float:
        if self.broken is not None:
            raise ConsensusTimeout(
                f"rank {self.rank}: cannot run '{what}': the communicator is unusable since "
                f"collective '{self.broken}' timed out")
        assert self.mpi is not None, "collective on a freed communicator"
        return time.monotonic() + self.timeout_s

    # -- collectives ------------------------------------------------------------------------
    def _allreduce(self, values: Sequence[int], op, what: str) -> np.ndarray:
        deadline = self._usable(what)
        send = np.asarray(values, dtype=np.int64).reshape(-1)
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

    def allgather_ints(self, values: Sequence[int], what: str) -> np.ndarray:
        """``[size, len(values)]`` int64: row r is rank r's ``values``."""
        deadline = self._usable(what)
        send = np.asarray(values, dtype=np.int64).reshape(-1)
        recv = np.empty((self.size, send.size), dtype=np.int64)
        self._wait(self.mpi.Iallgather(send, recv), deadline, what, (send, recv))
        return recv

    def allgather(self, obj: object, what: str) -> list[object]:
        """Every rank's picklable ``obj``, in rank order (two collectives: sizes, bytes)."""
        deadline = self._usable(what)
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        size = np.array([data.size], dtype=np.int64)
        sizes = np.empty(self.size, dtype=np.int64)
        self._wait(self.mpi.Iallgather(size, sizes), deadline, what, (size, sizes))
        offsets = np.zeros(self.size, dtype=np.int64)
        np.cumsum(sizes[:-1], out=offsets[1:])
        recv = np.empty(int(sizes.sum()), dtype=np.uint8)
        req = self.mpi.Iallgatherv(data, [recv, (sizes, offsets), self.MPI.BYTE])
        self._wait(req, deadline, what, (data, recv, sizes, offsets))
        return [pickle.loads(recv[o:o + n].tobytes()) for o, n in zip(offsets.tolist(), sizes.tolist())]

    def barrier(self, what: str) -> None:
        deadline = self._usable(what)
        self._wait(self.mpi.Ibarrier(), deadline, what, ())

    def free(self) -> None:
        """Release the Dup. After a timeout the Dup stays allocated: MPI may still
        progress the orphaned collective on it."""
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
