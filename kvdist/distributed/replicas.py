"""Replicas: a job of R data-parallel replicas, each a tensor-parallel (TP) group of T
ranks (world = R x T; replica r is ranks r*T .. r*T+T-1), and the two communicators
the remote tier needs (docs/design.md, "Remote tier"):

* ``tp`` — the ranks of this replica. Its collectives (bounded like every kvdist
  collective) carry the agreements that keep a replica's ranks identical (R1, R4) and
  ``check_consistency``. It never spans replicas.
* ``cross`` — the ranks with this rank's TP index, one per replica (its rank is the
  replica index). Point-to-point only after start-up (R3): the directory's messages
  and fetch requests travel here, shard-aligned (TP rank t only talks to TP rank t).

``distributed.tp_size: 0`` makes the whole job one replica: ``tp`` is then the
library's own communicator and there is no ``cross``."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .comm import MpiComm, SingleComm


@dataclass(frozen=True, slots=True)
class ReplicaLayout:
    """Where a rank sits among the replicas."""

    rank: int
    world_size: int
    tp_size: int  # ranks per replica (resolved: never 0)

    @classmethod
    def of(cls, rank: int, world_size: int, tp_size: int) -> ReplicaLayout:
        """The layout for ``distributed.tp_size`` (0 = one replica). A world size that is
        not a multiple of it is a ConfigError naming the key and both numbers."""
        tp = tp_size or world_size
        if world_size % tp:
            raise ConfigError("distributed.tp_size", tp_size,
                              f"the world size {world_size} is not a multiple of tp_size {tp_size}")
        return cls(rank, world_size, tp)

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.tp_size

    @property
    def replica(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    def world_rank(self, replica: int, tp_rank: int) -> int:
        return replica * self.tp_size + tp_rank


class ReplicaComms:
    """The TP group's communicator and the cross-replica one (see the module docstring).
    Built collectively over the library's communicator at start-up; ``free`` releases
    what was split off it."""

    def __init__(self, comm: MpiComm | SingleComm, layout: ReplicaLayout):
        self.layout = layout
        self.tp: MpiComm | SingleComm = comm
        self.cross = None  # an mpi4py communicator (a Split of the library's Dup), or None
        self._owns_tp = False
        if layout.num_replicas == 1:
            return
        assert isinstance(comm, MpiComm), "several replicas need MPI"
        split = comm.mpi.Split(layout.replica, layout.rank)
        try:
            self.tp = MpiComm(split, comm.timeout_s)  # its own Dup, bounded collectives
            self._owns_tp = True
        finally:
            split.Free()
        self.cross = comm.mpi.Split(layout.tp_rank, layout.replica)
        assert self.cross.Get_rank() == layout.replica, "cross rank must be the replica index"

    def free(self) -> None:
        if self.cross is not None:
            self.cross.Free()
            self.cross = None
        if self._owns_tp:
            self.tp.free()
            self._owns_tp = False
